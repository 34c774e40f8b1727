#include "tests/fuzz/replay.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>

#include "tests/fuzz/fuzz_target.h"
#include "tests/fuzz/mutator.h"

// Present only in sanitizer builds: lets the reporter run before a
// sanitizer ends the process with _exit (no signal to catch).
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace ddp::fuzz {
namespace {

// The input being run, for the crash reporter. Written only between inputs,
// read only from the handler, so plain globals suffice.
const Input* g_current = nullptr;
char g_crash_path[4096];
bool g_installed = false;

void WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

void WriteText(const char* text) { WriteAll(STDERR_FILENO, text, std::strlen(text)); }

// Only async-signal-safe calls: the process is going down.
void ReportCurrentInput() {
  static volatile sig_atomic_t reported = 0;
  if (reported || g_current == nullptr) return;
  reported = 1;
  WriteText("\n==== the crashing input: ");
  WriteText(g_current->name.c_str());
  WriteText(" (");
  char digits[32];
  int len = 0;
  size_t n = g_current->bytes.size();
  do {
    digits[len++] = static_cast<char>('0' + n % 10);
    n /= 10;
  } while (n > 0);
  std::reverse(digits, digits + len);
  digits[len] = '\0';
  WriteText(digits);
  WriteText(" bytes)\n");
  const int fd = open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    WriteAll(fd, g_current->bytes.data(), g_current->bytes.size());
    close(fd);
    WriteText("==== saved to ");
    WriteText(g_crash_path);
    WriteText("\n     (under bazel test: in the test's outputs.zip in bazel-testlogs)"
              "\n     replay it with: bazel run //tests/fuzz:<target> -- <the file>\n");
  }
}

void OnFatalSignal(int sig) {
  ReportCurrentInput();
  signal(sig, SIG_DFL);
  raise(sig);
}

std::string CrashDir() {
  const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  return dir != nullptr && *dir != '\0' ? dir : ".";
}

}  // namespace

std::vector<Input> LoadInputs(const std::string& path, std::string* error) {
  std::vector<Input> inputs;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    *error = path + ": " + std::strerror(errno);
    return {};
  }
  std::vector<std::string> files;
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = opendir(path.c_str());
    if (dir == nullptr) {
      *error = path + ": " + std::strerror(errno);
      return {};
    }
    while (dirent* e = readdir(dir)) {
      const std::string file = path + "/" + e->d_name;
      struct stat fst;
      if (stat(file.c_str(), &fst) == 0 && S_ISREG(fst.st_mode)) files.push_back(file);
    }
    closedir(dir);
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  for (const std::string& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    if (!in.good() && !in.eof()) {
      *error = file + ": cannot read";
      return {};
    }
    inputs.push_back({file, bytes.str()});
  }
  return inputs;
}

void InstallCrashReporter() {
  if (g_installed) return;
  g_installed = true;
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP}) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = OnFatalSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_NODEFER | SA_RESETHAND | SA_ONSTACK;
    sigaction(sig, &sa, nullptr);
  }
  if (__sanitizer_set_death_callback != nullptr) {
    __sanitizer_set_death_callback(&ReportCurrentInput);
  }
}

void RunInput(const Input& input) {
  const std::string path =
      CrashDir() + "/crash-" + std::to_string(HashName(input.bytes));
  std::snprintf(g_crash_path, sizeof(g_crash_path), "%s", path.c_str());
  g_current = &input;
  // An exception escaping the target is a crash under libFuzzer (terminate);
  // make it one here too, rather than a failure gtest catches and moves past.
  try {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.bytes.data()),
                           input.bytes.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "uncaught exception from the fuzz target: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "uncaught exception of unknown type from the fuzz target\n");
    std::abort();
  }
  g_current = nullptr;
}

void RunMutants(const std::vector<Input>& corpus, uint64_t seed, int count) {
  std::vector<std::string> bases;
  for (const Input& input : corpus) bases.push_back(input.bytes);
  Mutator mutator(std::move(bases), seed);
  for (int i = 0; i < count; ++i) {
    Input mutant{"mutant " + std::to_string(i) + " (seed " + std::to_string(seed) + ")",
                 mutator.Next()};
    RunInput(mutant);
  }
}

}  // namespace ddp::fuzz
