// LoadTensors from a path reads each tensor's bytes straight into the
// tensor: the file is never held whole beside the tensors made from it.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
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

// Bytes by which the peak resident size grew while `run` ran, as a forked
// child measures it (so that nothing this process did before counts), or -1
// when `run` returned false or threw.
int64_t PeakGrowthOf(const std::function<bool()>& run) {
  // The child starts with this process's resident pages as its peak: blocks
  // the allocator keeps from writing the file would hide the growth (the
  // load would reuse them), so they are given back first.
  CpuAllocator().EmptyCache();
  // So are the pages malloc keeps of freed blocks (building a test's file).
  malloc_trim(0);
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int64_t result = -1;
    try {
      struct rusage before, after;
      getrusage(RUSAGE_SELF, &before);
      const bool right = run();
      getrusage(RUSAGE_SELF, &after);
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

// The same for loading `path`, -1 also when the values read are wrong.
int64_t PeakGrowthOfLoading(const std::string& path) {
  return PeakGrowthOf([&] {
    const LoadedTensors loaded = LoadTensors(path);
    bool right = loaded.tensors.size() == static_cast<size_t>(kTensors);
    for (int k = 0; right && k < kTensors; ++k) {
      const auto* p = static_cast<const float*>(loaded.tensors[k].second.data_ptr());
      for (int64_t i = 0; i < kElements; i += 4093) right = right && p[i] == ValueAt(k, i);
      right = right && p[kElements - 1] == ValueAt(k, kElements - 1);
    }
    return right;
  });
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

// A file of `header` (padded to 8 bytes) and `data` at `path`.
void WriteFile(const std::string& path, std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << length << header << data;
}

// Hostile headers of 32 MiB (the format allows 100 MB): 700,000 small
// entries whose last one is bad; one entry with another key holding a list
// of 16 million numbers; a device record naming 2 million tensors the file
// does not hold. Before, each was parsed into a JSON value of the whole
// header (or record), with a set of every object's keys beside it: loading
// them grew the peak resident size by 15, 20 and 13 times the header's size
// (706 and 947 MiB for 48 MiB headers, 404 MiB for this record), and
// reading the first one's metadata alone by 12 times. Now the readers keep
// only what they return: the first and third are refused naming the file
// and the entry, the second loads, each within 6 times the header's size
// (about 3.5, 1 and 4: the record is held as metadata, and nlohmann's lexer
// holds a string token twice while reading it).
TEST(LoadTensorsFromPath, AHostileHeaderTakesAFewTimesItsSizeToReadNotTwentyTimes) {
  constexpr size_t kHeaderBytes = size_t{32} << 20;
  const std::string many = TmpPath("many_entries.safetensors");
  {
    std::string header = "{";
    for (int i = 0; header.size() < kHeaderBytes; ++i) {
      header += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)";
    }
    WriteFile(many, header + R"("zz":1})", "");
  }
  const std::string junk = TmpPath("junk_key.safetensors");
  {
    std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"note":[0)";
    while (header.size() < kHeaderBytes) header += ",0";
    WriteFile(junk, header + "]}}", "ab");
  }
  const std::string record = TmpPath("device_record.safetensors");
  {
    std::string devices = "{";
    for (int i = 0; devices.size() < kHeaderBytes - 1000; ++i) {
      devices += (i ? ",\\\"t" : "\\\"t") + std::to_string(i) + "\\\":\\\"cpu\\\"";
    }
    WriteFile(record, R"({"__metadata__":{")" + std::string(kDevicesKey) + R"(":")" + devices +
                          R"(}"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
              "ab");
  }
  const int64_t refused = PeakGrowthOf([&] {
    try {
      LoadTensors(many);
    } catch (const CheckpointError& e) {
      // The same error a load in this process would give: the file and
      // the entry named (parsed once, here, not again in this process).
      const std::string what = e.what();
      return what.find(many) != std::string::npos &&
             what.find("tensor `zz`: entry is number") != std::string::npos;
    }
    return false;
  });
  const int64_t loaded = PeakGrowthOf([&] { return LoadTensors(junk).tensors.size() == 1; });
  const int64_t metadata = PeakGrowthOf([&] { return SafetensorsFile::ReadMetadata(many).empty(); });
  const int64_t devices = PeakGrowthOf([&] {
    try {
      LoadTensors(record);
    } catch (const CheckpointError& e) {
      return std::string(e.what()).find("`, which the file does not hold") != std::string::npos;
    }
    return false;
  });
  std::remove(many.c_str());
  std::remove(junk.c_str());
  std::remove(record.c_str());
  ASSERT_GE(refused, 0) << "loading " << many << " did not end with an error naming it and `zz`";
  ASSERT_GE(loaded, 0) << "the file whose entry has another key did not load";
  ASSERT_GE(metadata, 0) << "ReadMetadata of the file of a million entries failed";
  ASSERT_GE(devices, 0) << "loading the file whose device record names other tensors did not end naming one";
  std::printf("peak resident growth for a %.0f MiB header: %.1f MiB refused, %.1f MiB loaded, %.1f MiB metadata, "
              "%.1f MiB device record\n",
              kHeaderBytes / 1048576.0, refused / 1048576.0, loaded / 1048576.0, metadata / 1048576.0,
              devices / 1048576.0);
  EXPECT_LT(static_cast<double>(refused), 6.0 * kHeaderBytes);
  EXPECT_LT(static_cast<double>(loaded), 6.0 * kHeaderBytes);
  EXPECT_LT(static_cast<double>(metadata), 6.0 * kHeaderBytes);
  EXPECT_LT(static_cast<double>(devices), 6.0 * kHeaderBytes);
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
