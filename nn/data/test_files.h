#ifndef DDP_NN_DATA_TEST_FILES_H_
#define DDP_NN_DATA_TEST_FILES_H_

// Test helpers: write crafted dataset files into a fresh folder under
// TEST_TMPDIR, wait for forked children with a deadline (and reap them on
// every way out of a test), and capture stderr.

#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ddp::nn::data::testing {

/// A new empty folder under TEST_TMPDIR (or /tmp), unique per call.
inline std::string FreshDir(const std::string& tag) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + tag + "_" +
                    std::to_string(::getpid()) + "_" + std::to_string(counter++);
  if (::mkdir(dir.c_str(), 0755) != 0) throw std::runtime_error("mkdir " + dir);
  return dir;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

/// gzip-compresses `bytes` (one member).
inline std::string Gzip(const std::string& bytes) {
  z_stream zs{};
  if (deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::runtime_error("deflateInit2");
  }
  std::string out(deflateBound(&zs, bytes.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs.avail_in = bytes.size();
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = out.size();
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) throw std::runtime_error("deflate");
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

/// IDX bytes: magic (0, 0, type, dims.size()), big-endian dims, then data.
inline std::string IdxBytes(const std::vector<uint32_t>& dims, const std::string& data,
                            uint8_t type = 0x08) {
  std::string s;
  s.push_back(0);
  s.push_back(0);
  s.push_back(static_cast<char>(type));
  s.push_back(static_cast<char>(dims.size()));
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  return s + data;
}

/// Writes an IDX file of unsigned bytes at `path`: `dims`, all zeros.
inline void WriteZeroIdx(const std::string& path, const std::vector<uint32_t>& dims) {
  size_t count = 1;
  for (uint32_t d : dims) count *= d;
  WriteFile(path, IdxBytes(dims, std::string(count, '\0')));
}

/// Waits for child `pid` to end, until `until`, and returns its wait status.
/// A child still running then is killed (SIGKILL), reaped, and the test
/// fails naming it, so that a blocked child fails the test in bounded time
/// instead of holding the whole binary until Bazel's timeout. Returns -1
/// (neither an exit nor a signal) whenever it has failed the test itself:
/// the child killed at `until`, no such child, or waitpid failing; a caller
/// that sees -1 has nothing to add about that child.
inline int WaitChild(pid_t pid, std::chrono::steady_clock::time_point until) {
  if (pid <= 0) {
    ADD_FAILURE() << "no child to wait for (pid " << pid << ")";
    return -1;
  }
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ADD_FAILURE() << "waitpid(" << pid << "): " << std::strerror(errno);
      return -1;
    }
    if (std::chrono::steady_clock::now() >= until) {
      ADD_FAILURE() << "child " << pid << " was still running at its deadline; killed";
      ::kill(pid, SIGKILL);  // still unreaped, so still this process's child
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return -1;
    }
    // No wait with a timeout exists for a child: look again in 1 ms.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

/// WaitChild for up to `timeout` from now.
inline int WaitChild(pid_t pid, std::chrono::milliseconds timeout) {
  return WaitChild(pid, std::chrono::steady_clock::now() + timeout);
}

/// Owns a forked child until Release(): a test that leaves before waiting
/// for it (a failed ASSERT, an exception) kills and reaps it here, so that
/// no child is left running or unreaped past its test.
class ChildReaper {
 public:
  explicit ChildReaper(pid_t pid) : pid_(pid) {}
  ~ChildReaper() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);  // unreaped, so still this process's child
    WaitChild(pid_, std::chrono::seconds(10));
  }
  ChildReaper(const ChildReaper&) = delete;
  ChildReaper& operator=(const ChildReaper&) = delete;

  /// The child's pid; the caller now waits for it.
  pid_t Release() {
    const pid_t pid = pid_;
    pid_ = -1;
    return pid;
  }

 private:
  pid_t pid_;
};

/// Captures stderr from construction until Take(). gtest allows one capture
/// at a time and aborts the binary at a second, so a capture that an ASSERT
/// or an exception left open is ended by the destructor, which passes on
/// what it caught.
class StderrCapture {
 public:
  StderrCapture() { ::testing::internal::CaptureStderr(); }
  ~StderrCapture() {
    if (open_) std::fputs(::testing::internal::GetCapturedStderr().c_str(), stderr);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;

  /// Ends the capture and returns what stderr received.
  std::string Take() {
    open_ = false;
    return ::testing::internal::GetCapturedStderr();
  }

 private:
  bool open_ = true;
};

/// Reads one byte from `fd` (a child's handshake pipe), waiting at most
/// `timeout` for it. False when none came by then, or at end of file (the
/// child closed its end, or died, without writing) or on an error; the
/// caller's assertion names what it waited for.
inline bool ReadByteWithin(int fd, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 0)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    char c;
    ssize_t n;
    while ((n = ::read(fd, &c, 1)) < 0 && errno == EINTR) {
    }
    return n == 1;
  }
}

/// How long the children of ErrorWithinAddressSpace may take in all, in one
/// test binary. Its users are size="small" tests (60 s for the binary) whose
/// children take under 1 s each (0.8 s the longest, seen) and whose other
/// tests take ~6 s: one budget for all the calls, rather than a limit per
/// call, keeps even a reader that hangs on every call inside the 60 s, so
/// that its failure says which call hung instead of Bazel's TIMEOUT losing
/// the binary's results.
inline constexpr std::chrono::seconds kAddressSpaceChildrenBudget{40};

/// The time ErrorWithinAddressSpace's children have taken so far in this
/// process (one counter for every instantiation; tests call it from one
/// thread).
inline std::chrono::steady_clock::duration& AddressSpaceChildrenTime() {
  static std::chrono::steady_clock::duration spent{};
  return spent;
}

/// Runs `f` in a child process whose address space may grow by at most
/// `headroom` bytes past the parent's size at the fork, and returns the
/// message of the `Error` that `f` throws; where it throws none, or the
/// child fails, a line starting "child: " that says so. A reader that takes a
/// multi-GiB file into memory then fails to allocate it instead of taking
/// the machine's memory. A child still running when this binary's
/// kAddressSpaceChildrenBudget is spent is killed and that said instead;
/// once it is spent, no child is started and that is said.
template <typename Error, typename F>
std::string ErrorWithinAddressSpace(size_t headroom, F&& f) {
  long vm_kb = -1;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stol(line.substr(7));
    }
  }
  if (vm_kb <= 0) return "child: no VmSize in /proc/self/status";
  const std::string budget = std::to_string(kAddressSpaceChildrenBudget.count()) + " s";
  std::chrono::steady_clock::duration& spent = AddressSpaceChildrenTime();
  if (spent >= kAddressSpaceChildrenBudget) {
    return "child: not started: earlier children took the " + budget + " this test binary allows them";
  }
  int fds[2];
  if (::pipe(fds) != 0) return std::string("child: pipe: ") + std::strerror(errno);
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    return std::string("child: fork: ") + std::strerror(error);
  }
  if (pid == 0) {
    ::close(fds[0]);
    std::string msg;
    struct rlimit lim{};
    if (::getrlimit(RLIMIT_AS, &lim) != 0) {
      msg = std::string("child: getrlimit: ") + std::strerror(errno);
    } else {
      lim.rlim_cur = static_cast<rlim_t>(vm_kb) * 1024 + headroom;
      if (::setrlimit(RLIMIT_AS, &lim) != 0) {
        msg = std::string("child: setrlimit: ") + std::strerror(errno);
      } else {
        try {
          f();
          msg = "child: no error thrown";
        } catch (const Error& e) {
          msg = e.what();
        } catch (const std::exception& e) {
          msg = std::string("child: another exception: ") + e.what();
        }
      }
    }
    for (size_t at = 0; at < msg.size();) {
      const ssize_t n = ::write(fds[1], msg.data() + at, msg.size() - at);
      if (n <= 0) ::_exit(1);
      at += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[4096];
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + (kAddressSpaceChildrenBudget - spent);
  bool late = false;
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      late = true;
      ::kill(pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      ::kill(pid, SIGKILL);
      break;  // poll itself failed: the child's answer is lost
    }
    if (ready == 0) continue;  // the deadline is checked above
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::kill(pid, SIGKILL);
      break;  // the child's answer is lost; the kill bounds the wait below
    }
    msg.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  pid_t waited;
  while ((waited = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  spent += std::chrono::steady_clock::now() - started;
  if (waited != pid) return std::string("child: waitpid: ") + std::strerror(errno);
  if (late) {
    return "child: still running when the " + budget + " this test binary allows its children were over (killed)";
  }
  if (WIFSIGNALED(status)) return std::string("child: died of signal ") + ::strsignal(WTERMSIG(status));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "child: could not write its message";
  return msg;
}

}  // namespace ddp::nn::data::testing

#endif  // DDP_NN_DATA_TEST_FILES_H_
