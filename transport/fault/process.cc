#include "transport/fault/process.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

namespace ddp::transport::fault {

bool ProcessGoneNow(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/exe", pid);
  char target[16];
  return readlink(path, target, sizeof(target)) < 0 && errno == ENOENT;
}

}  // namespace ddp::transport::fault
