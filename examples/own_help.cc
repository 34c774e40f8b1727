#include "examples/own_help.h"

#include <gflags/gflags.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "examples/setup_signals.h"

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
    // Written as a number, but larger than a double holds (either sign).
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(value.c_str(), &end);
    if (errno == ERANGE && end == value.c_str() + value.size() && std::isinf(v)) {
      return "a number of magnitude up to about 1.8e308";
    }
  }
  return "";
}

// For the decimal text of a number smaller than the smallest normal double
// (1e-310, 4.9e-324, or 1e-400, which is 0): the same double written
// exactly in hexadecimal ("0x1.7024c96ca3ce4p-1030"), which gflags reads;
// else "". gflags refuses the decimal text, since strtod flags its
// rounding with ERANGE, though it is a valid double (Python's float()
// and PyTorch take it). Underflow to zero keeps its sign ("-0x0p+0").
std::string ExactTextOfUnderflow(const std::string& value) {
  if (value.empty()) return "";
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(value.c_str(), &end);
  if (errno != ERANGE || end != value.c_str() + value.size() || std::isinf(v)) return "";
  char out[40];
  std::snprintf(out, sizeof(out), "%a", v);
  return out;
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

// Whether `value` is one of gflags' spellings of a bool (any case), and
// which one in `truth`.
bool BoolText(std::string value, bool* truth) {
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto in = [&value](std::initializer_list<const char*> spellings) {
    return std::find(spellings.begin(), spellings.end(), value) != spellings.end();
  };
  *truth = in({"1", "t", "true", "y", "yes"});
  return *truth || in({"0", "f", "false", "n", "no"});
}

// The flag of `file` at most two edits away from `name` ("" when none), for
// "did you mean --model?".
std::string NearestFlag(const std::string& name, const std::string& file) {
  std::string nearest;
  size_t best = 3;
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
  return nearest;
}

// Sets flag `info` to `value`, as parsing would next; when gflags refuses
// the value, the refusal, starting with `shown` (how the user gave it:
// "--seed=-1", or "--fromenv=seed: FLAGS_seed=-1"). A bool's values are
// checked without setting it (the help flags are bools, and gflags acts on
// them only when it parses).
std::string SetOrRefuse(const gflags::CommandLineFlagInfo& info, const std::string& value,
                        const std::string& shown) {
  bool truth = false;
  if (info.type == "bool" ? BoolText(value, &truth)
                          : !gflags::SetCommandLineOption(info.name.c_str(), value.c_str()).empty()) {
    return "";
  }
  if (const std::string range = OutOfRange(info.type, value); !range.empty()) {
    return shown + " is out of range: the flag takes " + range;
  }
  // On the command line CommandLineProblem has written such a value
  // exactly (SpellUnderflowsExactly); gflags reads a file of flags and the
  // environment itself.
  if (const std::string exact = info.type == "double" ? ExactTextOfUnderflow(value) : "";
      !exact.empty()) {
    return shown + ": gflags cannot read a number this small in decimal here; write it as " + exact +
           " (the same number, exactly) or give it on the command line";
  }
  const std::string takes = info.type == "bool"     ? "true or false"
                            : info.type == "double" ? "a number"
                            : info.type == "uint64" ? "a whole number, at least 0"
                            : info.type == "string" ? "a string"
                                                    : "a whole number";
  return shown + ": the flag takes " + takes;
}

// What is wrong with --fromenv=`names` (or --tryfromenv, `flag`): flags
// separated by commas, each set from the variable FLAGS_<name>, which
// --fromenv requires and --tryfromenv reads when set. gflags refuses each
// of these in its own words and exits 1 ("ERROR: FLAGS_seed not found in
// environment"); a value is checked as on the command line.
std::string FromEnvProblem(const std::string& flag, const std::string& names, const std::string& file) {
  const std::string shown = "--" + flag + "=" + names;
  // Split as gflags splits: a comma at the end ends the list.
  for (size_t at = 0; at < names.size();) {
    const size_t end = std::min(names.find(',', at), names.size());
    const std::string name = names.substr(at, end - at);
    at = end + 1;
    if (name.empty()) return shown + ": an empty name in the list; give flag names separated by commas";
    if (name[0] == '-') {
      const size_t letters = name.find_first_not_of('-');
      return shown + ": " + name + " is written with dashes; give the flag's name alone (--" + flag + "=" +
             (letters == std::string::npos ? "NAME" : name.substr(letters)) + ")";
    }
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      const std::string nearest = NearestFlag(name, file);
      return shown + ": unknown flag " + name + (nearest.empty() ? "" : "; did you mean " + nearest + "?") +
             " (--help lists the flags)";
    }
    const std::string variable = "FLAGS_" + name;
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) {
      if (flag == "tryfromenv") continue;
      return shown + ": " + variable + " is not set; set it (export " + variable +
             "=VALUE), or use --tryfromenv, which skips a flag whose variable is unset";
    }
    const std::string text = value;
    if (text == "fromenv" || text == "tryfromenv") {
      return shown + ": " + variable + "=" + text + " is refused by gflags (it would read the environment again)";
    }
    // Strings of other files are left alone: any text is one, and gflags'
    // (--flagfile and the like) act when set.
    if (EndsWith(info.filename, file) || info.type != "string") {
      if (std::string refused = SetOrRefuse(info, text, shown + ": " + variable + "=" + text); !refused.empty()) {
        return refused;
      }
    }
  }
  return "";
}

// The names in argv's --undefok (gflags' own: flags it lets pass though no
// library defines them, wherever --undefok comes; the last one counts), up
// to "--".
std::vector<std::string> UndefinedOk(int argc, char** argv) {
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    std::string list;
    if (arg == "--undefok" || arg == "-undefok") {
      if (i + 1 >= argc) break;
      list = argv[++i];
    } else if (arg.rfind("--undefok=", 0) == 0 || arg.rfind("-undefok=", 0) == 0) {
      list = arg.substr(arg.find('=') + 1);
    } else {
      continue;
    }
    names.clear();
    for (size_t at = 0; at < list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      names.push_back(list.substr(at, end - at));
      at = end + 1;
    }
  }
  return names;
}

// What one check carries from argument to argument and into the files of
// flags it reads.
struct Check {
  std::string file;                       // the program's source, "examples/train_main.cc"
  std::string argv0;                      // for the program-name sections of a file of flags
  std::vector<std::string> undefined_ok;  // names --undefok lets through
  std::vector<std::string> reading;       // files of flags being read, outermost first
  // Why --nproc_per_node is refused, for a program that starts no ranks;
  // "": the launcher takes it.
  std::string no_launcher;
};

std::string ArgProblem(const std::vector<std::string>& args, size_t* i, bool in_file, Check& check,
                       bool* located);

// Whether a line of a file of flags that names programs (gflags' sections:
// "train ddp_bench", or globs such as "*_bench") names this one, as gflags
// matches it: the whole argv[0] or its last component.
bool NamesThisProgram(const std::string& line, const std::string& argv0) {
  const std::string base = argv0.substr(argv0.rfind('/') + 1);
  for (size_t at = 0; at <= line.size();) {
    const size_t end = std::min(line.find(' ', at), line.size());
    const std::string glob = line.substr(at, end - at);
    if (glob == argv0 || glob == base || ::fnmatch(glob.c_str(), argv0.c_str(), FNM_PATHNAME) == 0 ||
        ::fnmatch(glob.c_str(), base.c_str(), FNM_PATHNAME) == 0) {
      return true;
    }
    at = end + 1;
  }
  return false;
}

// What is wrong with the flags in file `path` (a regular file), as gflags
// reads it: one flag a line ("--name=value", or "--name" for a bool),
// leading blanks skipped, "#" comments and empty lines ignored, and a line
// of program names starting a section whose flags apply to those programs
// only. gflags ignores an unknown flag there without a word (a misspelt one
// ran with the default) and refuses a bad value in its own words (exit 1):
// both are refused here as on the command line, with the file and the line
// ("flags.txt:3: unknown flag --modle; did you mean --model? ..."), and
// *located is set: the problem names its file and line. `content` is the
// file's text; the lines that apply to this program (leading blanks
// removed) are appended to `flags` when it is given, in order.
std::string LinesProblem(const std::string& path, const std::string& content, Check& check, bool* located,
                         std::vector<std::string>* flags) {
  bool relevant = true;
  bool in_names = false;
  int line_number = 0;
  for (size_t at = 0; at < content.size();) {
    // gflags ends a line at "\r" or "\n" ("\r\n": both).
    size_t end = content.find_first_of("\r\n", at);
    if (end == std::string::npos) end = content.size();
    std::string line = content.substr(at, end - at);
    ++line_number;
    at = end + (content.compare(end, 2, "\r\n") == 0 ? 2 : 1);
    line.erase(0, std::min(line.size(), line.find_first_not_of(" \t\v\f")));
    if (line.empty() || line[0] == '#') continue;
    if (line[0] != '-') {
      if (!in_names) relevant = false;  // a new section: for other programs unless it names this one
      in_names = true;
      relevant = relevant || NamesThisProgram(line, check.argv0);
      continue;
    }
    in_names = false;
    if (!relevant) continue;  // another program's flags
    const std::vector<std::string> one = {line};
    size_t i = 0;
    bool named = false;  // by a file of flags this line reads
    if (std::string problem = ArgProblem(one, &i, /*in_file=*/true, check, &named); !problem.empty()) {
      *located = true;
      return named ? problem : path + ":" + std::to_string(line_number) + ": " + problem;
    }
    if (flags != nullptr) flags->push_back(line);
  }
  return "";
}

// The whole of file `path` in *content, or why it cannot be read.
std::string ReadWhole(const std::string& path, std::string* content) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot read " + path + " (" + std::strerror(errno) + ")";
  content->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) return "cannot read " + path + " (" + std::strerror(errno) + ")";
  return "";
}

// A file of flags is a few lines of text: a stream that gives more is not
// one (/dev/zero, a device, a log piped in by mistake).
constexpr size_t kMaxStreamBytes = size_t{1} << 20;

// How long one wait for a stream's next bytes lasts at most: a signal taken
// in setup (InterruptedInSetup) is seen within it even when it came just
// before the wait began, or reached another thread, and poll went on.
constexpr int64_t kStreamSliceMs = 100;

// The whole of stream `path` (a FIFO, /dev/stdin, a terminal) in *content,
// or why not: it cannot be opened or read, holds more than kMaxStreamBytes,
// or has not ended (its writer closed it) within `wait`, or a signal was
// taken in setup before it ended (*interrupted then set). Read without
// blocking: a FIFO nobody writes to would hold the program forever.
std::string ReadStream(const std::string& path, std::string* content, std::chrono::milliseconds wait,
                       bool* interrupted) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "cannot read " + path + " (" + std::strerror(errno) + ")";
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::string problem;
  char buffer[65536];
  while (problem.empty()) {
    // Ctrl-C's line said "stopping": the rest of the wait (up to 120 s)
    // is not waited out.
    if (InterruptedInSetup()) {
      *interrupted = true;
      problem = "stopped reading " + path + " before its end (its writer had not closed it); none of its flags "
                "were taken";
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      problem = path + " did not end within " +
                (wait.count() % 1000 == 0 ? std::to_string(wait.count() / 1000) + " s"
                                          : std::to_string(wait.count()) + " ms") +
                " (a FIFO ends when its writer closes it)";
      break;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), kStreamSliceMs)));
    if (ready < 0 && errno != EINTR) problem = "cannot read " + path + " (" + std::strerror(errno) + ")";
    if (ready <= 0) continue;  // a FIFO with no writer yet reports nothing
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got == 0) break;  // its writer closed it (or Ctrl-D on a terminal)
    if (got < 0) {
      if (errno != EAGAIN && errno != EINTR) problem = "cannot read " + path + " (" + std::strerror(errno) + ")";
      continue;
    }
    if (content->size() + static_cast<size_t>(got) > kMaxStreamBytes) {
      problem = path + " holds more than " + std::to_string(kMaxStreamBytes >> 20) +
                " MiB: that is not a file of flags";
      break;
    }
    content->append(buffer, static_cast<size_t>(got));
  }
  ::close(fd);
  return problem;
}

// LinesProblem for the regular file `path`, read here.
std::string FileLinesProblem(const std::string& path, Check& check, bool* located) {
  std::string content;
  if (std::string problem = ReadWhole(path, &content); !problem.empty()) return problem;
  return LinesProblem(path, content, check, located, nullptr);
}

// Whether `path` is there and is neither a regular file nor a folder: a
// FIFO (a shell's <(...)), /dev/stdin, a terminal. What is read from it is
// gone for the next reader.
bool IsStream(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

// What is wrong with --flagfile=`value` (files separated by commas, read in
// turn as gflags reads them), or "". *located: the problem is in a file's
// line and names it.
std::string FlagfileProblem(const std::string& value, Check& check, bool* located) {
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
    // A FIFO, a terminal or /dev/stdin is not read here: what is read from
    // it is gone, and gflags, which reads it next, would find it empty (or
    // wait on it a second time). On the command line, InlineStreamFlagfiles
    // has put its flags in its place; one named in a file of flags is left
    // to gflags.
    if (S_ISREG(st.st_mode)) {
      if (std::find(check.reading.begin(), check.reading.end(), path) != check.reading.end()) {
        return path + " reads itself again through --flagfile (gflags would go round without end)";
      }
      check.reading.push_back(path);
      const std::string problem = FileLinesProblem(path, check, located);
      check.reading.pop_back();
      if (!problem.empty()) return problem;
    }
    if (end == value.size()) return "";
    at = end + 1;
  }
}

// What is wrong with the flag args[*i], or "". On the command line
// (!in_file) a flag's value may be the next argument, which it then takes
// (*i moves past it); in a file of flags each line is one argument, and a
// problem there is prefixed with the file and line by the caller unless
// *located says it names them already (a file of flags that another one
// reads).
std::string ArgProblem(const std::vector<std::string>& args, size_t* i, bool in_file, Check& check,
                       bool* located) {
  const std::string& arg = args[*i];
  const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
  // Not a flag: a value of the one before, or a stray argument (refused
  // after parsing); "-0.5" is a value. In a file, a line that starts with a
  // dash is always a flag.
  if (!in_file &&
      (dashes == 0 || arg.size() == dashes || !std::isalpha(static_cast<unsigned char>(arg[dashes])))) {
    return "";
  }
  const size_t eq = arg.find('=');
  std::string name = arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
  gflags::CommandLineFlagInfo info;
  if (in_file && eq == std::string::npos) {
    // "--seed 3": gflags takes no value after a blank in a file, and
    // ignored the whole line (the flag kept its default).
    const size_t blank = name.find_first_of(" \t");
    if (blank != std::string::npos && gflags::GetCommandLineFlagInfo(name.substr(0, blank).c_str(), &info)) {
      const size_t value = name.find_first_not_of(" \t", blank);
      return arg + ": in a file of flags the value follows '=': --" + name.substr(0, blank) + "=" +
             (value == std::string::npos ? "VALUE" : name.substr(value));
    }
  }
  // Only a separate value may follow on the command line.
  const bool value_next_allowed = !in_file && eq == std::string::npos;
  if (name == "flagfile") {
    // gflags' own: a missing file ended the program with "PATH: No such
    // file or directory" and exit status 1, and a folder was read as an
    // empty file, so the run went on with the defaults.
    if (eq == std::string::npos && (in_file || *i + 1 >= args.size())) {
      return "--flagfile needs a value: --flagfile=PATH";
    }
    const std::string value = value_next_allowed ? args[++*i] : arg.substr(eq + 1);
    bool nested = false;
    if (const std::string problem = FlagfileProblem(value, check, &nested); !problem.empty()) {
      *located = nested;
      return nested ? problem : "--flagfile=" + value + ": " + problem;
    }
    return "";
  }
  if (name == "fromenv" || name == "tryfromenv") {
    // gflags' own too, read when parsing reaches them.
    if (eq == std::string::npos && (in_file || *i + 1 >= args.size())) {
      return "--" + name + " needs a value: --" + name + "=FLAG[,FLAG...]";
    }
    const std::string value = value_next_allowed ? args[++*i] : arg.substr(eq + 1);
    return FromEnvProblem(name, value, check.file);
  }
  if (in_file && name == "undefok" && eq != std::string::npos) {
    // gflags' own; the names pass in the lines after it too.
    const std::string list = arg.substr(eq + 1);
    for (size_t at = 0; at < list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      check.undefined_ok.push_back(list.substr(at, end - at));
      at = end + 1;
    }
    return "";
  }
  if (!name.empty() && gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
    // "--model mlp": the next argument is the value.
    const bool separate = eq == std::string::npos && info.type != "bool";
    // gflags' "ERROR: flag '--helpon' is missing its argument; flag
    // description: ..." exited 1 (in a file, it ignored the line).
    if (separate && (in_file || *i + 1 >= args.size())) return "--" + name + " needs a value: --" + name + "=VALUE";
    if (separate) ++*i;
    // A value of the wrong type: gflags' "ERROR: illegal value '-1'
    // specified for uint64 flag 'seed'" exits 1. Setting it here is what
    // parsing does next anyway. Any text is a string: string flags of
    // other files are left alone, since gflags' (--flagfile, --helpon, ...)
    // act when set. The help flags are bools: "--help=foo" is refused here,
    // "--help=true" asks for help (ShowOwnHelpIfAsked); gflags' other help
    // flags (--helpfull, --helpon=FILE, --helpmatch=TEXT, --helpxml,
    // --helppackage, --version) pass, and gflags prints what they ask for
    // (for every linked library, which is their point) and exits.
    if ((eq != std::string::npos || separate) && (EndsWith(info.filename, check.file) || info.type != "string")) {
      const std::string value = separate ? args[*i] : arg.substr(eq + 1);
      return SetOrRefuse(info, value, "--" + name + "=" + value);
    }
    return "";
  }
  if (name == "nproc_per_node" || name == "nproc-per-node") {
    // SelfLaunchOrExit's own, when no gflags flag: it takes it in both
    // spellings with two dashes (and checks the value), from the command
    // line only. With one dash it takes neither, and gflags, parsing next,
    // refused it as unknown ("ERROR: unknown command line flag", exit 1)
    // once the ranks it had started without it parsed their flags; in a
    // file gflags ignored it, and the default number of ranks started.
    // A program that starts no ranks refuses it wherever it is, in its own
    // words (gflags refused it as unknown, or ignored it in a file).
    if (!check.no_launcher.empty()) return arg + ": " + check.no_launcher;
    if (in_file) {
      return arg + ": the launcher takes this flag on the command line only, not in a --flagfile; give it "
                   "there (--" + name + "=N)";
    }
    if (dashes == 1) {
      const bool value_next = value_next_allowed && *i + 1 < args.size() && args[*i + 1][0] != '-';
      const std::string given = value_next ? arg + " " + args[*i + 1] : arg;
      return given + ": the launcher takes this flag with two dashes: -" + given;
    }
    if (value_next_allowed) ++*i;
    return "";
  }
  if (name.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
      info.type == "bool") {
    return "";  // --nozero
  }
  // gflags lets these pass (--nofoo too for --undefok=foo), taking no
  // value after them: it does not know their type.
  const auto ok = [&check](const std::string& n) {
    return std::find(check.undefined_ok.begin(), check.undefined_ok.end(), n) != check.undefined_ok.end();
  };
  if (!name.empty() && (ok(name) || (name.rfind("no", 0) == 0 && ok(name.substr(2))))) return "";
  const std::string nearest = name.empty() ? "" : NearestFlag(name, check.file);
  return "unknown flag " + arg.substr(0, eq) + (nearest.empty() ? "" : "; did you mean --" + nearest + "?") +
         " (--help lists the flags)";
}

// Each value of a double flag on the command line (args[0] is the
// program) that is a decimal number below the smallest normal double is
// written in its exact hexadecimal form, which gflags, parsing next, reads
// as the same double (ExactTextOfUnderflow).
void SpellUnderflowsExactly(std::vector<std::string>& args) {
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") break;
    const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
    if (dashes == 0 || arg.size() == dashes || !std::isalpha(static_cast<unsigned char>(arg[dashes]))) continue;
    const size_t eq = arg.find('=');
    gflags::CommandLineFlagInfo info;
    const std::string name = arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info) || info.type == "bool") continue;
    // "--lr 1e-310": the value is the next argument.
    const size_t at = eq == std::string::npos ? i + 1 : i;
    if (at >= args.size()) break;
    if (info.type == "double") {
      const std::string value = eq == std::string::npos ? args[at] : arg.substr(eq + 1);
      if (const std::string exact = ExactTextOfUnderflow(value); !exact.empty()) {
        args[at] = eq == std::string::npos ? exact : arg.substr(0, eq + 1) + exact;
      }
    }
    i = at;
  }
}

}  // namespace

std::string FlagProblem(int argc, char** argv, const char* source, const char* no_launcher) {
  Check check;
  check.file = std::string(source) + ".cc";
  check.no_launcher = no_launcher == nullptr ? "" : no_launcher;
  check.argv0 = argc > 0 ? argv[0] : "";
  check.undefined_ok = UndefinedOk(argc, argv);
  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") break;  // gflags stops there too
    bool located = false;
    if (std::string problem = ArgProblem(args, &i, /*in_file=*/false, check, &located); !problem.empty()) {
      return problem;
    }
  }
  return "";
}

std::string InlineStreamFlagfiles(std::vector<std::string>& args, const char* source, const char* no_launcher,
                                  std::chrono::milliseconds stream_wait) {
  Check check;
  check.file = std::string(source) + ".cc";
  check.no_launcher = no_launcher == nullptr ? "" : no_launcher;
  check.argv0 = args.empty() ? "" : args[0];
  {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    check.undefined_ok = UndefinedOk(static_cast<int>(argv.size()), argv.data());
  }
  std::vector<std::string> streams_read;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string arg = args[i];
    if (arg == "--") break;  // gflags stops there too
    const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
    const size_t eq = arg.find('=');
    if (dashes == 0 || arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes) != "flagfile") {
      continue;
    }
    const bool separate = eq == std::string::npos;
    if (separate && i + 1 >= args.size()) break;  // FlagProblem says what is missing
    const std::string value = separate ? args[i + 1] : arg.substr(eq + 1);
    // The files in turn: regular ones stay for gflags (and FlagProblem),
    // each stream gives way to its flags.
    std::vector<std::string> replacement;
    std::vector<std::string> regular;  // files since the last stream that are none (or missing)
    const auto take_regular = [&replacement, &regular] {
      if (regular.empty()) return;
      std::string joined = "--flagfile=" + regular[0];
      for (size_t k = 1; k < regular.size(); ++k) joined += "," + regular[k];
      replacement.push_back(joined);
      regular.clear();
    };
    bool any_stream = false;
    for (size_t at = 0; at <= value.size();) {
      const size_t end = std::min(value.find(',', at), value.size());
      const std::string path = value.substr(at, end - at);
      at = end + 1;
      if (!IsStream(path)) {
        regular.push_back(path);
        continue;
      }
      any_stream = true;
      take_regular();
      if (std::find(streams_read.begin(), streams_read.end(), path) != streams_read.end()) {
        return "--flagfile=" + value + ": " + path +
               " was read already (a stream is read once: its flags were taken the first time); name it once";
      }
      streams_read.push_back(path);
      std::string content;
      bool interrupted = false;
      if (std::string problem = ReadStream(path, &content, stream_wait, &interrupted); !problem.empty()) {
        if (interrupted) StopIfInterruptedInSetup("--flagfile=" + value + ": " + problem);
        return "--flagfile=" + value + ": " + problem;
      }
      bool located = false;
      if (std::string problem = LinesProblem(path, content, check, &located, &replacement); !problem.empty()) {
        return located ? problem : "--flagfile=" + value + ": " + problem;
      }
    }
    if (!any_stream) {
      if (separate) ++i;
      continue;
    }
    take_regular();
    args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i + (separate ? 2 : 1)));
    args.insert(args.begin() + static_cast<std::ptrdiff_t>(i), replacement.begin(), replacement.end());
    // Its flags are looked at again: one may name another stream.
    --i;
  }
  return "";
}

std::string CommandLineProblem(int* argc, char*** argv, const char* source, const char* no_launcher) {
  // gflags keeps pointers into argv (its --helpfull lists argv[0]), and a
  // self-launching program hands it to its ranks: both live as long as
  // the process.
  static std::vector<std::string> args;
  static std::vector<char*> pointers;
  // *argv may point into `args` after a first call, and gflags keeps its
  // pointers: a second call would pull the storage from under both.
  static bool called = false;
  if (called) return "CommandLineProblem is called once per process, before gflags parses";
  called = true;
  args.assign(*argv, *argv + *argc);
  std::string problem = InlineStreamFlagfiles(args, source, no_launcher);
  if (problem.empty()) SpellUnderflowsExactly(args);
  pointers.clear();
  for (std::string& a : args) pointers.push_back(a.data());
  pointers.push_back(nullptr);
  *argc = static_cast<int>(args.size());
  *argv = pointers.data();
  return problem.empty() ? FlagProblem(*argc, *argv, source, no_launcher) : problem;
}

bool ShowOwnHelpIfAsked(int argc, char** argv, const char* source) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    // "--help=true" as well: gflags takes it, and would print the flags of
    // every linked library ("--help=false" asks for nothing).
    bool asked = true;
    if (arg == "-h" || (dashes > 0 && (name == "help" || name == "helpshort") &&
                        (eq == std::string::npos || (BoolText(arg.substr(eq + 1), &asked) && asked)))) {
      PrintOwnFlags(argv[0], source);
      return true;
    }
  }
  return false;
}

}  // namespace ddp::examples
