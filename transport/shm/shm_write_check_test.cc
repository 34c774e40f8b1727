// Writes by pid (cross-memory attach) into a peer and the checks of its
// pidfd around them. This binary's process_vm_writev and poll stand in for
// the C library's: the first can make the peer exit, and another process
// take its pid, inside a write (between any check before it and the
// write); the second counts the polls of pidfds.

#include <dlfcn.h>
#include <errno.h>
#include <linux/sched.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm/shm_allreduce.h"
#include "transport/testing/in_memory_store.h"

namespace {

// The pid whose first write by this process makes it exit and hands its
// pid to a copy of this process (0: none); the copy's pid once made.
std::atomic<pid_t> replace_on_write{0};
std::atomic<pid_t> replacement{0};
int replace_error = 0;
// Polls of a pidfd by the thread counting (counting_polls).
thread_local bool counting_polls = false;
thread_local int pidfd_polls = 0;

bool IsPidfd(int fd) {
  char target[64];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(link.c_str(), target, sizeof(target));
  return n > 0 && std::string(target, static_cast<size_t>(n)) == "anon_inode:[pidfd]";
}

// A copy of this process under `pid` that waits to be killed (clone3's
// set_tid: root may choose a free pid); -1 with errno from clone3.
pid_t CopyAs(pid_t pid) {
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&pid);
  args.set_tid_size = 1;
  const pid_t copy = static_cast<pid_t>(syscall(SYS_clone3, &args, sizeof(args)));
  if (copy == 0) {
    while (true) pause();
  }
  return copy;
}

}  // namespace

extern "C" ssize_t process_vm_writev(pid_t pid, const iovec* local, unsigned long local_count,
                                     const iovec* remote, unsigned long remote_count,
                                     unsigned long flags) noexcept {
  pid_t armed = pid;
  if (pid > 0 && replace_on_write.compare_exchange_strong(armed, 0)) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    const pid_t copy = CopyAs(pid);
    replace_error = errno;
    replacement = copy;
  }
  return syscall(SYS_process_vm_writev, pid, local, local_count, remote, remote_count, flags);
}

extern "C" int poll(pollfd* fds, nfds_t count, int timeout) {
  using PollFn = int (*)(pollfd*, nfds_t, int);
  static const PollFn real = reinterpret_cast<PollFn>(dlsym(RTLD_NEXT, "poll"));
  if (counting_polls && count == 1 && IsPidfd(fds[0].fd)) ++pidfd_polls;
  return real(fds, count, timeout);
}

namespace ddp::transport::shm {
namespace {

using std::chrono::milliseconds;

// Rank 0 is this process; rank 1 is a thread of it whose pid in the group
// is a forked child's (a copy of this process, so that the probe of
// cross-memory attach reads what it expects, and every buffer allocated
// before the fork lies at the same address there).
struct PairWithChildPeer {
  pid_t child = -1;
  std::vector<std::unique_ptr<ShmAllReduce>> group;
  ~PairWithChildPeer() {
    if (child > 0) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
    }
  }
};

void MakePair(const std::string& key_prefix, PairWithChildPeer& pair) {
  pair.child = fork();
  if (pair.child < 0) return;
  if (pair.child == 0) {
    while (true) pause();
  }
  pair.group.resize(2);
  testing::InMemoryStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ShmOptions options{.rank = r, .size = 2, .pids = {getpid(), pair.child},
                         .staging_bytes = 4096, .rooted_staging_bytes = 4096, .chunk_bytes = 4096};
      auto engine = ShmAllReduce::Create(store, key_prefix, options, DeadlineIn(milliseconds(10000)));
      EXPECT_TRUE(engine.ok()) << engine.status();
      if (engine.ok()) pair.group[r] = std::move(*engine);
    });
  }
  for (std::thread& t : threads) t.join();
}

// Rank 0 gathers `count` floats into rank 1's output by pid; returns rank
// 0's status. The watchdog says nothing, so that the waits do not look at
// the pidfd themselves.
Status GatherToChild(PairWithChildPeer& pair, std::vector<float>& gathered, size_t count,
                     int* polls) {
  auto silent = [](Deadline, int) { return Status::Ok(); };
  std::vector<float> mine(count, 3.0f);
  Status status;
  std::thread root([&] {
    std::vector<float> own(count, 5.0f);
    pair.group[1]->Gather(own.data(), gathered.data(), count, DataType::kF32, 1,
                          DeadlineIn(milliseconds(5000)), silent).IgnoreError();
  });
  counting_polls = true;
  pidfd_polls = 0;
  status = pair.group[0]->Gather(mine.data(), nullptr, count, DataType::kF32, 1,
                                 DeadlineIn(milliseconds(5000)), silent);
  counting_polls = false;
  if (polls != nullptr) *polls = pidfd_polls;
  root.join();
  return status;
}

// The peer exits, and a copy of this process takes its pid, while rank 0
// writes into the peer's output by pid: after the check before the write.
// The write lands in the copy (which maps the same output), and the call
// returned OK; the pidfd is now asked after the write too, so the call
// fails PEER_LOST naming the peer.
TEST(ShmWriteCheck, AWriteThatRacedThePeersExitAndPidReuseFailsPeerLost) {
  const size_t count = 4096;  // 16 KiB from rank 0: above the rooted staging limit
  std::vector<float> gathered(2 * count, 0.0f);
  PairWithChildPeer pair;
  MakePair("raced/", pair);
  ASSERT_GT(pair.child, 0) << "fork: " << std::strerror(errno);
  ASSERT_TRUE(pair.group[0] != nullptr && pair.group[1] != nullptr);
  const pid_t peer = pair.child;
  replace_on_write = peer;
  const Status status = GatherToChild(pair, gathered, count, nullptr);
  replace_on_write = 0;
  pair.child = -1;  // reaped in process_vm_writev
  const pid_t copy = replacement.exchange(0);
  if (copy > 0) {
    kill(copy, SIGKILL);
    waitpid(copy, nullptr, 0);
  }
  ASSERT_EQ(copy, peer) << "clone3 with set_tid: " << std::strerror(replace_error);
  EXPECT_EQ(status.code(), StatusCode::kPeerLost) << status;
  EXPECT_NE(status.message().find("rank 1 (pid " + std::to_string(peer) + ") exited"),
            std::string::npos)
      << status;
}

// A write by pid of several 4 MiB pieces asks the peer's pidfd before and
// after it, not before each piece (a system call per piece on the path of
// every large write).
TEST(ShmWriteCheck, AWriteOfManyPiecesPollsThePidfdTwice) {
  const size_t count = (size_t{20} << 20) / sizeof(float);  // 20 MiB: five pieces
  std::vector<float> gathered(2 * count, 0.0f);
  PairWithChildPeer pair;
  MakePair("pieces/", pair);
  ASSERT_GT(pair.child, 0) << "fork: " << std::strerror(errno);
  ASSERT_TRUE(pair.group[0] != nullptr && pair.group[1] != nullptr);
  int polls = -1;
  const Status status = GatherToChild(pair, gathered, count, &polls);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(polls, 2);
}

}  // namespace
}  // namespace ddp::transport::shm
