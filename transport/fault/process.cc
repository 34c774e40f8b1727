#include "transport/fault/process.h"

#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace ddp::transport::fault {

namespace {

// Reads /proc/PID/stat of process `pid` of this host into `line` and
// returns the ')' that closes the name (field 2, in parentheses, may hold
// spaces and ')': the other fields follow the last ')'), or nullptr when
// there is no such process or /proc cannot be read.
const char* StatNameEnd(int pid, char (&line)[1024]) {
  if (pid <= 0) return nullptr;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return nullptr;
  const size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char* p = std::strrchr(line, ')');
  return p != nullptr && p[1] == ' ' ? p : nullptr;
}

// The number of threads of process `pid`, or 0 when it cannot be told.
// From the link count of /proc/PID/task (two more than its threads), which
// stat() gives without a descriptor: the fallback runs with none left too.
int ThreadCount(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/task", pid);
  struct stat task {};
  if (stat(path, &task) != 0 || task.st_nlink < 2) return 0;
  return static_cast<int>(task.st_nlink - 2);
}

}  // namespace

uint64_t ProcessStartTime(int pid) {
  char line[1024];
  const char* p = StatNameEnd(pid, line);
  // Field 22 is the 20th after the name (field 2).
  for (int field = 2; field < 22 && p != nullptr; ++field) p = std::strchr(p + 1, ' ');
  if (p == nullptr) return 0;
  unsigned long long ticks = 0;
  return std::sscanf(p + 1, "%llu", &ticks) == 1 ? ticks : 0;
}

uint64_t TicksSinceBoot() {
  timespec now{};
  const long ticks_per_s = sysconf(_SC_CLK_TCK);
  if (clock_gettime(CLOCK_BOOTTIME, &now) != 0 || ticks_per_s <= 0) return 0;
  // Rounded down, as the kernel rounds a start time.
  return static_cast<uint64_t>(now.tv_sec) * static_cast<uint64_t>(ticks_per_s) +
         static_cast<uint64_t>(now.tv_nsec) / (1000000000ull / static_cast<uint64_t>(ticks_per_s));
}

char ProcessState(int pid) {
  char line[1024];
  const char* p = StatNameEnd(pid, line);
  return p != nullptr ? p[2] : 0;
}

bool ProcessGoneNow(int pid, uint64_t start_time) {
  // No process has such a pid, and kill() would ask about a process group
  // (0: this one's, -N: N's) or, for -1, every process this one may signal.
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  if (start_time != 0) {
    const uint64_t now = ProcessStartTime(pid);
    if (now != 0 && now != start_time) return true;  // another process has the pid
  }
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/exe", pid);
  char target[16];
  if (readlink(path, target, sizeof(target)) >= 0 || errno != ENOENT) return false;
  // No memory under the pid's own thread: the process exited, or only its
  // main thread did (pthread_exit) while others run on, which the kernel
  // shows alike (state Z, no exe). An exited one counts its last thread
  // until it is reaped; more than one is a process still at work.
  return ThreadCount(pid) <= 1;
}

}  // namespace ddp::transport::fault
