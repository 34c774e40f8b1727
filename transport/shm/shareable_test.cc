#include "transport/shm/shareable.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace ddp::transport::shm {
namespace {

// A new shareable block of `size` bytes, each 'a'; null (the failure
// recorded) when it cannot be allocated.
unsigned char* ShareableFilledWithA(size_t size) {
  auto block = AllocateShareable(size);
  EXPECT_TRUE(block.ok()) << block.status();
  if (!block.ok()) return nullptr;
  auto* bytes = static_cast<unsigned char*>(*block);
  std::memset(bytes, 'a', size);
  return bytes;
}

// A forked child that writes a shareable block writes its own copy, as it
// would any other memory of its parent's; the parent's block is unchanged,
// and the parent's own writes still reach the memfd that peers map.
TEST(Shareable, ForkedChildWritesItsOwnCopy) {
  constexpr size_t kBytes = 1 << 20;
  auto* bytes = ShareableFilledWithA(kBytes);
  ASSERT_NE(bytes, nullptr);

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::memset(bytes, 'b', kBytes);
    _exit(bytes[kBytes - 1] == 'b' ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child could not write its copy";
  size_t changed = 0;
  for (size_t i = 0; i < kBytes; ++i) changed += bytes[i] != 'a';
  EXPECT_EQ(changed, 0u) << "the child's writes reached the parent's block";

  // The parent's mapping is still the shared one: a write shows in the memfd.
  bytes[0] = 'c';
  auto region = FindShareable(bytes, kBytes);
  ASSERT_TRUE(region.has_value());
  unsigned char first = 0;
  ASSERT_EQ(pread(region->fd, &first, 1, 0), 1);
  EXPECT_EQ(first, 'c');
  EXPECT_TRUE(FreeShareable(bytes).ok());
}

// In a forked child the inherited block is a private copy, so its memfd no
// longer holds what the child reads and writes there. FindShareable must
// not offer it: a collective in the child would publish the memfd, and its
// peers would fold the parent's data and write their results into the
// parent's block instead of the child's. A block the child allocates
// itself is shareable as usual.
TEST(Shareable, ForkedChildDoesNotOfferItsPrivateCopy) {
  constexpr size_t kBytes = 64 << 10;
  auto* bytes = ShareableFilledWithA(kBytes);
  ASSERT_NE(bytes, nullptr);

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Exit codes: 0 right; 1 the inherited block was offered; 2 it was
    // offered and its memfd disagrees with the child's memory; 3 the
    // child's own block was not offered; 4 freeing failed.
    std::memset(bytes, 'b', kBytes);
    int code = 0;
    if (auto region = FindShareable(bytes, kBytes); region.has_value()) {
      unsigned char first = 0;
      code = pread(region->fd, &first, 1, 0) == 1 && first != bytes[0] ? 2 : 1;
    }
    auto own = AllocateShareable(4096);
    if (code == 0 && (!own.ok() || !FindShareable(*own, 4096).has_value())) code = 3;
    if (code == 0 && (!FreeShareable(*own).ok() || !FreeShareable(bytes).ok())) code = 4;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: the child's private copy was offered as shareable; 2: and its memfd holds other "
         "bytes than the child's memory; 3: a block allocated in the child was not shareable; "
         "4: freeing failed";
  EXPECT_EQ(bytes[0], 'a');
  EXPECT_TRUE(FindShareable(bytes, kBytes).has_value()) << "the parent's block is still shareable";
  EXPECT_TRUE(FreeShareable(bytes).ok());
}

// A child that writes an inherited block and forks again hands its own
// bytes to its child, as fork does with any memory: the grandchild must
// see 'b' (the child's), not the original process's 'a'.
TEST(Shareable, GrandchildKeepsItsParentsWritesToAnInheritedBlock) {
  constexpr size_t kBytes = 64 << 10;
  auto* bytes = ShareableFilledWithA(kBytes);
  ASSERT_NE(bytes, nullptr);

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::memset(bytes, 'b', kBytes);
    const pid_t grandchild = fork();
    if (grandchild < 0) _exit(3);
    if (grandchild == 0) {
      size_t lost = 0;
      for (size_t i = 0; i < kBytes; ++i) lost += bytes[i] != 'b';
      _exit(lost == 0 ? 0 : 1);
    }
    int status = 0;
    if (waitpid(grandchild, &status, 0) != grandchild || !WIFEXITED(status)) _exit(4);
    if (WEXITSTATUS(status) != 0) _exit(1);
    _exit(bytes[0] == 'b' ? 0 : 2);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1: the grandchild saw other bytes than its parent had written; 2: the child's own "
         "copy changed; 3, 4: fork or wait failed";
  EXPECT_EQ(bytes[0], 'a');
  EXPECT_TRUE(FreeShareable(bytes).ok());
}

// A child that cannot map an inherited block privately (out of memory or
// of mappings in the fork handler) must not keep the parent's shared
// mapping writable: its first write would change the parent's block. The
// block is read-only in the child instead (it may still read it), and its
// stderr names the block.
TEST(Shareable, ChildThatCannotCopyABlockCannotWriteTheParents) {
  constexpr size_t kBytes = 64 << 10;
  auto* bytes = ShareableFilledWithA(kBytes);
  ASSERT_NE(bytes, nullptr);

  // The child's stderr goes to a pipe: the fork handler writes there.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const int saved_stderr = dup(STDERR_FILENO);
  ASSERT_GE(saved_stderr, 0);
  ASSERT_GE(dup2(pipe_fds[1], STDERR_FILENO), 0);
  FailPrivatizingInForkedChildrenForTest(true);
  const pid_t child = fork();
  if (child == 0) {
    size_t unlike = 0;
    for (size_t i = 0; i < kBytes; ++i) unlike += bytes[i] != 'a';
    if (unlike != 0) _exit(1);
    std::memset(bytes, 'b', kBytes);
    _exit(0);
  }
  FailPrivatizingInForkedChildrenForTest(false);
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  close(pipe_fds[1]);
  ASSERT_GE(child, 0);

  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  std::string said;
  char chunk[256];
  for (ssize_t n; (n = read(pipe_fds[0], chunk, sizeof chunk)) > 0;) said.append(chunk, n);
  close(pipe_fds[0]);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV)
      << "the child's write to the block should fault (exit 1: it could not read the block); wait "
         "status "
      << status;
  size_t changed = 0;
  for (size_t i = 0; i < kBytes; ++i) changed += bytes[i] != 'a';
  EXPECT_EQ(changed, 0u) << "the child's writes reached the parent's block";
  char address[32];
  std::snprintf(address, sizeof address, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(bytes)));
  EXPECT_NE(said.find("could not map its copy of the block at " + std::string(address)), std::string::npos)
      << said;
  EXPECT_NE(said.find("ENOMEM"), std::string::npos) << said;
  EXPECT_NE(said.find("read-only in the child"), std::string::npos) << said;
  EXPECT_TRUE(FindShareable(bytes, kBytes).has_value()) << "the parent's block is still shareable";
  EXPECT_TRUE(FreeShareable(bytes).ok());
}

}  // namespace
}  // namespace ddp::transport::shm
