#include "nn/tensor/env_value.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace ddp::nn {

std::optional<bool> ParseOnOff(const char* name, const char* text, std::string* problem) {
  if (text == nullptr || text[0] == '\0') return std::nullopt;
  std::string lower = text;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* off : {"0", "off", "false", "no", "none"}) {
    if (lower == off) return false;
  }
  for (const char* on : {"1", "on", "true", "yes"}) {
    if (lower == on) return true;
  }
  *problem = std::string(name) + "=" + text +
             " is neither on (1, on, true, yes) nor off (0, off, false, no, none)";
  return std::nullopt;
}

std::optional<int64_t> ParseSeconds(const char* name, const char* text, int64_t most, std::string* problem) {
  if (text == nullptr || text[0] == '\0') return std::nullopt;
  // Digits only: strtoll alone would take "12abc" as 12 and " 5" as 5.
  int64_t seconds = 0;
  bool fits = true;
  for (const char* p = text; *p != '\0'; ++p) {
    if (!std::isdigit(static_cast<unsigned char>(*p))) {
      fits = false;
      break;
    }
    seconds = seconds * 10 + (*p - '0');
    if (seconds > most) {
      fits = false;
      break;
    }
  }
  if (fits && seconds >= 1) return seconds;
  *problem = std::string(name) + "=" + text + " is not a whole number of seconds in [1, " + std::to_string(most) + "]";
  return std::nullopt;
}

bool OnOffFromEnv(const char* name, bool fallback, const std::string& kept) {
  std::string problem;
  const std::optional<bool> value = ParseOnOff(name, std::getenv(name), &problem);
  if (!problem.empty()) std::fprintf(stderr, "[ddp] warning: %s; keeping %s\n", problem.c_str(), kept.c_str());
  return value.value_or(fallback);
}

}  // namespace ddp::nn
