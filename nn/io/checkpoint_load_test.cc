// LoadTensors from a path reads each tensor's bytes straight into the
// tensor: the file is never held whole beside the tensors made from it.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "nn/io/atomic_file.h"
#include "nn/io/checkpoint.h"
#include "nn/io/testing/io_test_util.h"
#include "nn/tensor/allocator.h"

namespace ddp::nn::io {
namespace {

using test_util::ErrorOf;
using test_util::TmpPath;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The value element `i` of tensor `k` is saved with.
float ValueAt(int k, int64_t i) { return static_cast<float>(k * 1000003 + i % 999983); }

constexpr int kTensors = 8;
constexpr int64_t kElements = int64_t{8} << 20;  // 32 MiB of f32 each, 256 MiB in all
constexpr uint64_t kDataBytes = uint64_t{kTensors} * kElements * 4;

// A 256 MiB file of f32 tensors, written once for the suite. The tensors
// are freed once written, so a process forked afterwards starts small.
class LargeFile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(TmpPath("large.safetensors"));
    NamedTensors tensors;
    for (int k = 0; k < kTensors; ++k) {
      Tensor t = Empty({kElements}, {.dtype = DType::kFloat32});
      auto* p = static_cast<float*>(t.data_ptr());
      for (int64_t i = 0; i < kElements; ++i) p[i] = ValueAt(k, i);
      tensors.emplace_back("t" + std::to_string(k), std::move(t));
    }
    SaveTensors(*path_, tensors);
  }
  static void TearDownTestSuite() {
    std::remove(path_->c_str());
    delete path_;
    path_ = nullptr;
  }
  static std::string* path_;
};
std::string* LargeFile::path_ = nullptr;

// Bytes by which the peak resident size grew while loading the file, as a
// forked child measures it (so that nothing this process did before counts),
// or -1 when the load failed or gave wrong values.
int64_t PeakGrowthOfLoading(const std::string& path) {
  // The child starts with this process's resident pages as its peak: blocks
  // the allocator keeps from writing the file would hide the growth (the
  // load would reuse them), so they are given back first.
  CpuAllocator().EmptyCache();
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int64_t result = -1;
    try {
      struct rusage before, after;
      getrusage(RUSAGE_SELF, &before);
      const LoadedTensors loaded = LoadTensors(path);
      getrusage(RUSAGE_SELF, &after);
      bool right = loaded.tensors.size() == static_cast<size_t>(kTensors);
      for (int k = 0; right && k < kTensors; ++k) {
        const auto* p = static_cast<const float*>(loaded.tensors[k].second.data_ptr());
        for (int64_t i = 0; i < kElements; i += 4093) right = right && p[i] == ValueAt(k, i);
        right = right && p[kElements - 1] == ValueAt(k, kElements - 1);
      }
      if (right) result = (static_cast<int64_t>(after.ru_maxrss) - before.ru_maxrss) * 1024;  // KiB
    } catch (...) {
    }
    const ssize_t w = write(fds[1], &result, sizeof(result));
    _exit(w == sizeof(result) ? 0 : 1);
  }
  close(fds[1]);
  int64_t result = -1;
  if (pid < 0 || read(fds[0], &result, sizeof(result)) != sizeof(result)) result = -1;
  close(fds[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  return result;
}

// Before, the whole file was read into memory and each tensor copied out of
// it: loading took twice the file's size.
TEST_F(LargeFile, LoadingGrowsThePeakResidentSizeByAboutTheFileNotTwice) {
  const int64_t growth = PeakGrowthOfLoading(*path_);
  ASSERT_GE(growth, 0) << "the child's load failed or gave wrong values";
  std::printf("peak resident growth: %.1f MiB for %.1f MiB of tensor data\n", growth / 1048576.0,
              kDataBytes / 1048576.0);
  EXPECT_LT(static_cast<double>(growth), 1.3 * static_cast<double>(kDataBytes));
}

// The stop flag is looked at between pieces of kStopCheckBytes: set while
// the first piece is read, the load ends before the second.
TEST_F(LargeFile, StopFlagSetMidLoadEndsItAtTheNextPiece) {
  std::atomic<bool> stop{false};
  std::vector<uint64_t> pieces;
  internal::SetReadPieceHookForTesting([&](uint64_t got) {
    pieces.push_back(got);
    if (pieces.size() == 2) stop = true;
  });
  const std::string error = ErrorOf([&] { LoadTensors(*path_, {.stop = &stop}); });
  internal::SetReadPieceHookForTesting({});
  ASSERT_EQ(pieces.size(), 2u);
  const uint64_t size = static_cast<uint64_t>(std::ifstream(*path_, std::ios::binary | std::ios::ate).tellg());
  EXPECT_EQ(pieces[1] - pieces[0], kStopCheckBytes);
  EXPECT_EQ(size - pieces[0], kDataBytes);  // the first piece starts at the data region
  EXPECT_THAT(error, AllOf(HasSubstr(*path_), HasSubstr("the read was stopped after " +
                                                         std::to_string(pieces[1]) + " of " +
                                                         std::to_string(size) + " bytes")));
}

// A file cut short while its tensors are read (another process rewriting
// it in place, a network filesystem's file truncated by its writer): the
// error names the tensor whose bytes ran out, as the check of a file found
// short before the read does. Before, it gave only the byte count.
TEST(LoadTensorsFromPath, AFileCutShortDuringTheReadNamesTheTensor) {
  const std::string path = TmpPath("cut_during_read.safetensors");
  Tensor a = Zeros({16}, {.dtype = DType::kFloat32});
  Tensor b = Zeros({1000}, {.dtype = DType::kFloat32});
  SaveTensors(path, {{"first", a}, {"second.weight", b}});
  const uint64_t size = static_cast<uint64_t>(std::ifstream(path, std::ios::binary | std::ios::ate).tellg());
  const uint64_t data_start = size - 16 * 4 - 1000 * 4;
  int truncated = -1;
  internal::SetReadPieceHookForTesting([&](uint64_t got) {
    if (got == data_start) truncated = ::truncate(path.c_str(), static_cast<off_t>(data_start + 16 * 4 + 100));
  });
  const std::string error = ErrorOf([&] { LoadTensors(path); });
  internal::SetReadPieceHookForTesting({});
  ASSERT_EQ(truncated, 0) << "the read never reached the data region";
  EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("in tensor `second.weight`"),
                           HasSubstr("the file got shorter while read")));
  std::remove(path.c_str());
}

// One byte of tensor data flipped: the data checksum, computed as the
// tensors are read, refuses the file.
TEST(LoadTensorsFromPath, OneFlippedByteOfTensorDataIsRefusedNamingTheChecksum) {
  const std::string path = TmpPath("flipped.safetensors");
  Tensor a = Empty({1000}, {.dtype = DType::kFloat32});
  Tensor b = Empty({3, 5}, {.dtype = DType::kInt64});
  for (int i = 0; i < 1000; ++i) static_cast<float*>(a.data_ptr())[i] = 0.5f * i;
  for (int i = 0; i < 15; ++i) static_cast<int64_t*>(b.data_ptr())[i] = i - 7;
  SaveTensors(path, {{"a", a}, {"b", b}});
  EXPECT_EQ(LoadTensors(path).tensors.size(), 2u);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() - 4000 - 3] ^= 0x10;  // inside `a`
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("data region checksum is"), HasSubstr("the header says"),
                    HasSubstr("the tensor data is corrupt")));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace ddp::nn::io
