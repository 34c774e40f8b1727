#include "examples/trainer/format.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace ddp::examples::trainer {

std::string StringPrintf(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::string out;
  if (n > 0) {
    out.resize(static_cast<size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, args);
    out.resize(static_cast<size_t>(n));
  }
  va_end(args);
  return out;
}

std::string FormatCount(int64_t n) {
  const bool negative = n < 0;
  // The magnitude in unsigned arithmetic: -n overflows for INT64_MIN.
  const uint64_t magnitude = negative ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  const std::string digits = std::to_string(magnitude);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return negative ? "-" + out : out;
}

namespace {

// Above this (1e15 s, about 32 million years; 1e15 per second for a rate),
// values are shown as "%.3g": they are far past anything a run shows
// exactly, and the conversion to an integer would overflow (undefined
// behaviour) not far above, at 2^63.
constexpr double kMostShownExactly = 1e15;

}  // namespace

std::string FormatClock(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  if (seconds >= kMostShownExactly) return StringPrintf("%.3gs", seconds);
  const int64_t s = static_cast<int64_t>(seconds);
  if (s >= 3600) {
    return StringPrintf("%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                        static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  }
  return StringPrintf("%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
}

std::string FormatSeconds(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  // Below 99.95, not 100: "%.1f" rounds 99.97 up to "100.0s", past the
  // switch to minutes ("1m40s" from 100 on).
  if (seconds < 99.95) return StringPrintf("%.1fs", seconds);
  if (seconds >= kMostShownExactly) return StringPrintf("%.3gs", seconds);
  const int64_t s = static_cast<int64_t>(std::lround(seconds));
  if (s < 3600) {
    return StringPrintf("%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  }
  return StringPrintf("%lldh%02lldm", static_cast<long long>(s / 3600),
                      static_cast<long long>(s / 60 % 60));
}

std::string FormatRate(double per_second) {
  if (!std::isfinite(per_second) || per_second < 0) return "-";
  if (per_second >= kMostShownExactly) return StringPrintf("%.3g", per_second);
  return FormatCount(std::llround(per_second));
}

std::string ExactDouble(double value) { return StringPrintf("%a", value); }

double ParseExactDouble(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  // strtod skips leading white space, which ExactDouble never writes: text
  // that starts with it is not one of ours.
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) {
    throw std::invalid_argument("not a number: '" + text + "'");
  }
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) {
    throw std::invalid_argument("not a number: '" + text + "'");
  }
  // strtod reports ERANGE for a subnormal result as well as for overflow
  // and underflow to zero: a subnormal --lr or --weight_decay is a value
  // (ExactDouble writes it, and a resume must read it back), but a number
  // past a double's range, or one so small that it reads as a (signed)
  // zero, is not the value written.
  if (errno == ERANGE && std::isinf(v)) {
    throw std::invalid_argument("out of a double's range: '" + text + "'");
  }
  if (errno == ERANGE && v == 0) {
    throw std::invalid_argument("too small for a double (it would read as 0): '" + text + "'");
  }
  return v;
}

double ParseFiniteDouble(const std::string& text) {
  const double v = ParseExactDouble(text);
  if (!std::isfinite(v)) throw std::invalid_argument("not a finite number: '" + text + "'");
  return v;
}

}  // namespace ddp::examples::trainer
