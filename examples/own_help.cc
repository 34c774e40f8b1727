#include "examples/own_help.h"

#include <gflags/gflags.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::examples {
namespace {

bool EndsWith(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

// Levenshtein distance, for suggesting a flag for a misspelt one.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// For a value gflags refused for a flag of type `type` ("int32", "int64",
// "uint64", "double"): the range the flag takes, when the value is written
// as one of its type but does not fit in it ("99999999999" for an int32,
// "1e400" for a double); else "". Such a value is a number all the same,
// so "the flag takes a whole number" would tell the user nothing.
std::string OutOfRange(const std::string& type, const std::string& value) {
  const size_t sign = !value.empty() && (value[0] == '-' || value[0] == '+') ? 1 : 0;
  const bool digits = value.size() > sign && value.find_first_not_of("0123456789", sign) == std::string::npos;
  if (type == "int32" && digits) {
    return "a whole number from " + std::to_string(std::numeric_limits<int32_t>::min()) + " to " +
           std::to_string(std::numeric_limits<int32_t>::max());
  }
  if (type == "int64" && digits) {
    return "a whole number from " + std::to_string(std::numeric_limits<int64_t>::min()) + " to " +
           std::to_string(std::numeric_limits<int64_t>::max());
  }
  // A negative one is no whole number "at least 0" either: said as before.
  if (type == "uint64" && digits && value[0] != '-') {
    return "a whole number from 0 to " + std::to_string(std::numeric_limits<uint64_t>::max());
  }
  if (type == "double" && !value.empty()) {
    // Written as a number, but past what a double holds (either way).
    char* end = nullptr;
    errno = 0;
    std::strtod(value.c_str(), &end);
    if (errno == ERANGE && end == value.c_str() + value.size()) {
      return "a number of magnitude from about 2.2e-308 to 1.8e308, or 0";
    }
  }
  return "";
}

// A double as it was most likely written: the fewest digits that read back
// as the same value ("0.05", where gflags shows "0.050000000000000003").
std::string ShortestDouble(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) return text;
  char out[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(out, sizeof(out), "%.*g", digits, v);
    if (std::strtod(out, nullptr) == v) break;
  }
  return out;
}

// gflags' ShowUsageWithFlagsRestrict(argv0, source), in its layout (usage
// message, "Flags from FILE:", one DescribeOneFlag each), for the flags of
// `source` alone, with double defaults as written.
void PrintOwnFlags(const char* argv0, const char* source) {
  const std::string file = std::string(source) + ".cc";
  const std::string program = argv0;
  std::printf("%s: %s\n", program.substr(program.rfind('/') + 1).c_str(), gflags::ProgramUsage());
  std::vector<gflags::CommandLineFlagInfo> all;
  gflags::GetAllFlags(&all);
  bool header = false;
  for (gflags::CommandLineFlagInfo flag : all) {
    if (!EndsWith(flag.filename, file)) continue;
    if (!header) {
      std::printf("\n  Flags from %s:\n", flag.filename.c_str());
      header = true;
    }
    if (flag.type == "double") {
      flag.default_value = ShortestDouble(flag.default_value);
      flag.current_value = ShortestDouble(flag.current_value);
    }
    std::printf("%s", gflags::DescribeOneFlag(flag).c_str());
  }
}

// Why a --flagfile value (files separated by commas, as gflags reads it)
// cannot be read as files of flags, or "".
std::string FlagfileProblem(const std::string& value) {
  size_t at = 0;
  while (true) {
    const size_t end = std::min(value.find(',', at), value.size());
    const std::string path = value.substr(at, end - at);
    struct stat st{};
    if (path.empty()) return "an empty file name; give the path of a file of flags";
    if (::stat(path.c_str(), &st) != 0 || ::access(path.c_str(), R_OK) != 0) {
      return "cannot read " + path + " (" + std::strerror(errno) + ")";
    }
    if (S_ISDIR(st.st_mode)) return path + " is a folder; give the path of a file of flags";
    if (end == value.size()) return "";
    at = end + 1;
  }
}

}  // namespace

std::string FlagProblem(int argc, char** argv, const char* source) {
  const std::string file = std::string(source) + ".cc";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;  // gflags stops there too
    const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
    // Not a flag: a value of the one before, or a stray argument (refused
    // after parsing); "-0.5" is a value.
    if (dashes == 0 || arg.size() == dashes || !std::isalpha(static_cast<unsigned char>(arg[dashes]))) continue;
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    gflags::CommandLineFlagInfo info;
    if (name == "flagfile") {
      // gflags' own: a missing file ended the program with "PATH: No such
      // file or directory" and exit status 1, and a folder was read as an
      // empty file, so the run went on with the defaults.
      const bool separate = eq == std::string::npos;
      if (separate && i + 1 >= argc) return "--flagfile needs a value: --flagfile=PATH";
      const std::string value = separate ? argv[++i] : arg.substr(eq + 1);
      if (const std::string problem = FlagfileProblem(value); !problem.empty()) {
        return "--flagfile=" + value + ": " + problem;
      }
      continue;
    }
    if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      // "--model mlp": the next argument is the value.
      const bool separate = eq == std::string::npos && info.type != "bool";
      if (separate) ++i;
      // A value of the wrong type: gflags' "ERROR: illegal value '-1'
      // specified for uint64 flag 'seed'" exits 1. Setting it here is what
      // parsing does next anyway (this program's own flags only: gflags'
      // --flagfile and the like act when set).
      if (EndsWith(info.filename, file) && (eq != std::string::npos || separate)) {
        if (separate && i >= argc) return "--" + name + " needs a value: --" + name + "=VALUE";
        const std::string value = separate ? argv[i] : arg.substr(eq + 1);
        if (gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty()) {
          if (const std::string range = OutOfRange(info.type, value); !range.empty()) {
            return "--" + name + "=" + value + " is out of range: the flag takes " + range;
          }
          const std::string takes = info.type == "bool"     ? "true or false"
                                    : info.type == "double" ? "a number"
                                    : info.type == "uint64" ? "a whole number, at least 0"
                                    : info.type == "string" ? "a string"
                                                            : "a whole number";
          return "--" + name + "=" + value + ": the flag takes " + takes;
        }
      }
      continue;
    }
    if (name == "nproc_per_node" || name == "nproc-per-node") {
      // SelfLaunchOrExit's own, in both its spellings (it checks the
      // value), when no gflags flag.
      if (eq == std::string::npos) ++i;
      continue;
    }
    if (name.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
        info.type == "bool") {
      continue;  // --nozero
    }
    std::string nearest;
    size_t best = 3;  // suggest only what is at most two edits away
    std::vector<gflags::CommandLineFlagInfo> all;
    gflags::GetAllFlags(&all);
    for (const gflags::CommandLineFlagInfo& flag : all) {
      if (!EndsWith(flag.filename, file)) continue;
      const size_t d = EditDistance(name, flag.name);
      if (d < best) {
        best = d;
        nearest = flag.name;
      }
    }
    return "unknown flag " + arg.substr(0, eq) + (nearest.empty() ? "" : "; did you mean --" + nearest + "?") +
           " (--help lists the flags)";
  }
  return "";
}

bool ShowOwnHelpIfAsked(int argc, char** argv, const char* source) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help" || arg == "-help" || arg == "--helpshort") {
      PrintOwnFlags(argv[0], source);
      return true;
    }
  }
  return false;
}

}  // namespace ddp::examples
