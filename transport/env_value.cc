#include "transport/env_value.h"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <system_error>
#include <utility>

namespace ddp::transport {
namespace {

Status Bad(std::string_view name, std::string_view value, std::string_view expected) {
  return InvalidArgumentError(std::string(name) + "=" + std::string(value) + ": expected " +
                              std::string(expected));
}

// Decimal digits only (no sign, space or base prefix); nullopt otherwise.
// Too many for 64 bits saturate, so that the caller reports its limit.
std::optional<uint64_t> ParseDigits(std::string_view text) {
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  uint64_t value = 0;
  const std::from_chars_result parsed = std::from_chars(text.data(), text.data() + text.size(), value);
  if (parsed.ec == std::errc::result_out_of_range) return std::numeric_limits<uint64_t>::max();
  return value;
}

// `bytes` as the error messages write a limit: "1073741824 (1G)".
std::string BytesText(uint64_t bytes) {
  std::string text = std::to_string(bytes);
  for (auto [shift, unit] : {std::pair{30, 'G'}, std::pair{20, 'M'}, std::pair{10, 'K'}}) {
    if (bytes != 0 && bytes % (uint64_t{1} << shift) == 0) {
      return text + " (" + std::to_string(bytes >> shift) + unit + ")";
    }
  }
  return text;
}

}  // namespace

std::string GetEnv(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

StatusOr<bool> ParseEnvBool(std::string_view name, std::string_view value) {
  std::string lower(value);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "1" || lower == "true" || lower == "on" || lower == "yes") return true;
  if (lower == "0" || lower == "false" || lower == "off" || lower == "no") return false;
  return Bad(name, value, "1, true, on, yes or 0, false, off, no (any case)");
}

StatusOr<uint64_t> ParseEnvBytes(std::string_view name, std::string_view value, uint64_t max) {
  constexpr std::string_view kForm =
      "a byte count: digits, optionally followed by K, M or G (KiB, MiB, GiB)";
  int shift = 0;
  std::string_view digits = value;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: break;
    }
    if (shift != 0) digits.remove_suffix(1);
  }
  const std::optional<uint64_t> count = ParseDigits(digits);
  if (!count) return Bad(name, value, kForm);
  const std::string limit = "at most " + BytesText(max) + " bytes";
  if (*count > (std::numeric_limits<uint64_t>::max() >> shift)) return Bad(name, value, limit);
  const uint64_t bytes = *count << shift;
  if (bytes > max) return Bad(name, value, limit);
  return bytes;
}

StatusOr<uint64_t> ParseEnvCount(std::string_view name, std::string_view value, uint64_t max) {
  const std::optional<uint64_t> count = ParseDigits(value);
  if (!count) return Bad(name, value, "digits (a whole number)");
  if (*count > max) return Bad(name, value, "at most " + std::to_string(max));
  return *count;
}

StatusOr<std::optional<bool>> EnvBool(const char* name) {
  const std::string value = GetEnv(name);
  if (value.empty()) return std::optional<bool>();
  DDP_ASSIGN_OR_RETURN(const bool on, ParseEnvBool(name, value));
  return std::optional<bool>(on);
}

StatusOr<std::optional<uint64_t>> EnvBytes(const char* name, uint64_t max) {
  const std::string value = GetEnv(name);
  if (value.empty()) return std::optional<uint64_t>();
  DDP_ASSIGN_OR_RETURN(const uint64_t bytes, ParseEnvBytes(name, value, max));
  return std::optional<uint64_t>(bytes);
}

StatusOr<std::optional<uint64_t>> EnvCount(const char* name, uint64_t max) {
  const std::string value = GetEnv(name);
  if (value.empty()) return std::optional<uint64_t>();
  DDP_ASSIGN_OR_RETURN(const uint64_t count, ParseEnvCount(name, value, max));
  return std::optional<uint64_t>(count);
}

}  // namespace ddp::transport
