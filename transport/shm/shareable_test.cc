#include "transport/shm/shareable.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"

namespace ddp::transport::shm {
namespace {

// A forked child that writes a shareable block writes its own copy, as it
// would any other memory of its parent's; the parent's block is unchanged,
// and the parent's own writes still reach the memfd that peers map.
TEST(Shareable, ForkedChildWritesItsOwnCopy) {
  constexpr size_t kBytes = 1 << 20;
  auto block = AllocateShareable(kBytes);
  ASSERT_TRUE(block.ok()) << block.status();
  auto* bytes = static_cast<unsigned char*>(*block);
  std::memset(bytes, 'a', kBytes);

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

}  // namespace
}  // namespace ddp::transport::shm
