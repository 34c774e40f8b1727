// The decoded cache over real files: a second load maps the entry the first
// wrote; a corrupted entry, a changed source, an entry of another file and an
// unwritable folder all fall back to decoding, with the right bytes; "off"
// writes nothing.
#include "nn/data/decoded_cache.h"

#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <future>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nn/data/cifar.h"
#include "nn/data/idx.h"
#include "nn/data/test_files.h"
#include "nn/io/atomic_file.h"

namespace ddp::nn::data::internal {
namespace {

using testing::ChildReaper;
using testing::FreshDir;
using testing::Gzip;
using testing::IdxBytes;
using testing::ReadByteWithin;
using testing::StderrCapture;
using testing::WaitChild;
using testing::WriteFile;

// How long a forked child may take before it is killed and the test fails
// (each does a few small loads), and how long a handshake byte from a child
// may take to come.
constexpr std::chrono::seconds kChildDeadline{30};
constexpr std::chrono::seconds kHandshakeDeadline{20};

// Sets DDP_DATA_CACHE for a scope.
class CacheDir {
 public:
  explicit CacheDir(const std::string& dir) {
    const char* was = std::getenv("DDP_DATA_CACHE");
    had_ = was != nullptr;
    if (had_) was_ = was;
    ::setenv("DDP_DATA_CACHE", dir.c_str(), 1);
  }
  ~CacheDir() {
    if (had_) {
      ::setenv("DDP_DATA_CACHE", was_.c_str(), 1);
    } else {
      ::unsetenv("DDP_DATA_CACHE");
    }
  }

 private:
  bool had_ = false;
  std::string was_;
};

std::vector<std::filesystem::path> Entries(const std::string& dir) {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

// A decode that counts its calls and reads the IDX file.
struct CountingDecode {
  std::string path;
  int calls = 0;
  std::pair<std::vector<int64_t>, std::vector<uint8_t>> operator()() {
    ++calls;
    IdxArray a = ReadIdxFile(path);
    return {a.dims, a.data};
  }
};

std::vector<uint8_t> Bytes(const SharedArray& a) { return std::vector<uint8_t>(a.data, a.data + a.size); }

std::string Pixels(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 7 + 3);
  return s;
}

std::vector<uint8_t> Want(size_t n) {
  const std::string s = Pixels(n);
  return std::vector<uint8_t>(s.begin(), s.end());
}

// Writes a source of 10x8 bytes at `dir`/images and loads it once, through
// `decode` (which reads that file), into the cache folder `dir`/cache that
// the caller has set: the entry's path, the folder's only file (empty, with a
// failure added, when the folder holds another number of files).
std::filesystem::path LoadIntoOneEntry(const std::string& dir, CountingDecode& decode) {
  WriteFile(decode.path, IdxBytes({10, 8}, Pixels(80)));
  LoadDecoded(decode.path, std::ref(decode), 0);
  const auto entries = Entries(dir + "/cache");
  if (entries.size() != 1) {
    ADD_FAILURE() << dir << "/cache holds " << entries.size() << " files, not one entry";
    return {};
  }
  return entries[0];
}

// Flips the last byte of `entry` (a data byte): its CRC no longer matches.
void FlipLastByte(const std::filesystem::path& entry) {
  std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-1, std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-1, std::ios::end);
  c = static_cast<char>(c ^ 0x5a);
  f.write(&c, 1);
  if (!f) ADD_FAILURE() << "cannot flip the last byte of " << entry;
}

TEST(DecodedCache, SecondLoadMapsTheEntryTheFirstWrote) {
  const std::string dir = FreshDir("decoded_hit");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images.gz";
  WriteFile(src, Gzip(IdxBytes({5, 4, 3}, Pixels(60))));
  CountingDecode decode{src};
  const SharedArray first = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 1);
  ASSERT_EQ(Entries(dir + "/cache").size(), 1u) << "one entry, no temporary left";
  const SharedArray second = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 1) << "the entry was not used";
  EXPECT_EQ(second.dims, (std::vector<int64_t>{5, 4, 3}));
  EXPECT_EQ(Bytes(second), Bytes(first));
  EXPECT_EQ(Bytes(second), Want(60));
}

TEST(DecodedCache, CorruptedEntryIsDecodedAgainAndRewritten) {
  const std::string dir = FreshDir("decoded_corrupt");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  CountingDecode decode{src};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  FlipLastByte(entry);
  const SharedArray again = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2);
  EXPECT_EQ(Bytes(again), Want(80));
  LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2) << "the rewritten entry was not used";
  // A truncated entry likewise.
  std::filesystem::resize_file(entry, 40);
  EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(80));
  EXPECT_EQ(decode.calls, 3);
}

// An entry cut short after the load measured it and mapped it, while the
// load checks it through the mapping (another program truncating it in
// place meanwhile), is decoded and written again: the check's read past
// the cut killed the process with SIGBUS.
TEST(DecodedCache, AnEntryCutShortWhileItIsCheckedIsDecodedAgain) {
  const std::string dir = FreshDir("decoded_cut_in_check");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  CountingDecode decode{src};
  // 16 KiB of pixels: pages past the cut, which the CRC then reads.
  WriteFile(src, IdxBytes({64, 256}, Pixels(64 * 256)));
  LoadDecoded(src, std::ref(decode), 0);
  ASSERT_EQ(decode.calls, 1);
  // Cut after the first page: the header stays whole (a cut inside it
  // reads as zeros there, which the header's comparison refuses), the
  // data's later pages are gone.
  const auto page = static_cast<uintmax_t>(::sysconf(_SC_PAGESIZE));
  int cuts = 0;
  SetBeforeMappingCheckHookForTesting([&cuts, page](const std::string& path) {
    std::filesystem::resize_file(path, page);
    ++cuts;
  });
  const SharedArray again = LoadDecoded(src, std::ref(decode), 0);
  SetBeforeMappingCheckHookForTesting(nullptr);
  EXPECT_EQ(cuts, 1);
  EXPECT_EQ(decode.calls, 2);
  EXPECT_EQ(again.dims, (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(Bytes(again), Want(64 * 256));
  const SharedArray mapped = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2) << "no whole entry was written in the cut one's place";
  EXPECT_EQ(Bytes(mapped), Want(64 * 256));
}

void ProgramsSigbusHandler(int, siginfo_t*, void*) {}

// Loading and mapping an entry leaves the process's SIGBUS action as its
// program set it. The cache installed a handler of its own at its first
// mapping, which then ran the program's without its flags or mask (a
// one-shot handler, SA_RESETHAND, was called again at each repeated fault:
// an endless loop). A truncated mapped entry kills with SIGBUS, as any
// mapped file; the program decides what that does.
TEST(DecodedCacheDeathTest, MappingAnEntryLeavesTheProgramsSigbusActionAsItWas) {
  // A fresh process, in which no entry was mapped before.
  const std::string style = ::testing::GTEST_FLAG(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        struct sigaction mine{};
        mine.sa_sigaction = ProgramsSigbusHandler;
        mine.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER;
        sigemptyset(&mine.sa_mask);
        sigaddset(&mine.sa_mask, SIGUSR1);
        if (::sigaction(SIGBUS, &mine, nullptr) != 0) std::_Exit(2);
        const std::string dir = FreshDir("decoded_sigbus_action");
        const CacheDir cache(dir + "/cache");
        const std::string src = dir + "/images";
        CountingDecode decode{src};
        WriteFile(src, IdxBytes({64, 256}, Pixels(64 * 256)));
        LoadDecoded(src, std::ref(decode), 0);
        const SharedArray mapped = LoadDecoded(src, std::ref(decode), 0);
        if (decode.calls != 1 || Bytes(mapped) != Want(64 * 256)) {
          std::fprintf(stderr, "the second load did not map the entry\n");
          std::_Exit(3);
        }
        struct sigaction now{};
        if (::sigaction(SIGBUS, nullptr, &now) != 0) std::_Exit(2);
        if ((now.sa_flags & SA_SIGINFO) == 0 || now.sa_sigaction != ProgramsSigbusHandler) {
          std::fprintf(stderr, "the SIGBUS handler was replaced\n");
          std::_Exit(4);
        }
        const int flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER;
        if ((now.sa_flags & flags) != flags || sigismember(&now.sa_mask, SIGUSR1) != 1) {
          std::fprintf(stderr, "the SIGBUS action's flags or mask changed\n");
          std::_Exit(5);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  GTEST_FLAG_SET(death_test_style, style);
}

// A FIFO where the entry should be is no entry: the load decodes and puts a
// real entry in its place (opening the FIFO for reading waited for a writer,
// so the load hung without a word).
TEST(DecodedCache, AFifoAtTheEntryIsDecodedWithoutWaitingForAWriter) {
  const std::string dir = FreshDir("decoded_fifo");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  CountingDecode decode{src};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  std::filesystem::remove(entry);
  ASSERT_EQ(::mkfifo(entry.c_str(), 0644), 0) << entry;
  auto load = std::async(std::launch::async, [&] { return Bytes(LoadDecoded(src, std::ref(decode), 0)); });
  const bool returned = load.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  // Lets a load stuck in the FIFO's opens (it tries the entry twice) go on,
  // so that the test ends.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (load.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready &&
         std::chrono::steady_clock::now() < deadline) {
    const int fd = ::open(entry.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) ::close(fd);
  }
  ASSERT_EQ(load.wait_for(std::chrono::seconds(0)), std::future_status::ready) << "stuck in " << entry;
  EXPECT_TRUE(returned) << "the load waited on the FIFO at " << entry;
  EXPECT_EQ(load.get(), Want(80));
  EXPECT_EQ(decode.calls, 2);
  EXPECT_TRUE(std::filesystem::is_regular_file(entry)) << "no entry written in the FIFO's place";
}

// The pages of the open file `fd` of `bytes` bytes that are in memory.
size_t ResidentPages(int fd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return SIZE_MAX;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((bytes + page - 1) / page);
  const bool ok = ::mincore(p, bytes, in.data()) == 0;
  ::munmap(p, bytes);
  if (!ok) return SIZE_MAX;
  return static_cast<size_t>(std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; }));
}

// A large file of another kind at the entry's name is refused on its first
// bytes and replaced by an entry, without reading it (the file was mapped
// and read whole, 64 MiB here, before its header was looked at). The file
// is sparse, so only what the load reads of it comes into memory.
TEST(DecodedCache, ALargeForeignFileAtTheEntryIsRefusedWithoutReadingIt) {
  const std::string dir = FreshDir("decoded_foreign");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  CountingDecode decode{src};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  constexpr size_t kForeignBytes = size_t{64} << 20;
  WriteFile(entry, "<!DOCTYPE html> not a decoded cache entry");
  std::filesystem::resize_file(entry, kForeignBytes);
  const int foreign = ::open(entry.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(foreign, 0) << entry;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t before = ResidentPages(foreign, kForeignBytes);
  ASSERT_LE(before, 2u) << "the sparse file's holes are in memory before the load";
  EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(80));
  EXPECT_EQ(decode.calls, 2);
  EXPECT_LT(std::filesystem::file_size(entry), size_t{4096}) << "no entry in the foreign file's place";
  // A header read may bring its readahead window (128 KiB by default) in.
  const size_t after = ResidentPages(foreign, kForeignBytes);
  EXPECT_LE(after * page, size_t{4} << 20) << "the load read " << after << " of the foreign file's "
                                          << kForeignBytes / page << " pages";
  ::close(foreign);
  LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2) << "the entry written in the foreign file's place was not used";
}

TEST(DecodedCache, ChangedSourceIsDecodedAgain) {
  const std::string dir = FreshDir("decoded_changed");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({4, 2}, Pixels(8)));
  CountingDecode decode{src};
  LoadDecoded(src, std::ref(decode), 0);
  // Same size, new bytes, a later modification time.
  std::string other = Pixels(8);
  other[0] = 'z';
  WriteFile(src, IdxBytes({4, 2}, other));
  struct timespec times[2] = {{0, UTIME_OMIT}, {0, 0}};
  ::clock_gettime(CLOCK_REALTIME, &times[1]);
  times[1].tv_sec += 10;
  ASSERT_EQ(::utimensat(AT_FDCWD, src.c_str(), times, 0), 0);
  const SharedArray now = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2);
  EXPECT_EQ(Bytes(now), std::vector<uint8_t>(other.begin(), other.end()));
  // The new version has an entry of its own (the name hashes the source's
  // stats), mapped from now on; the old one is left to eviction.
  EXPECT_EQ(Entries(dir + "/cache").size(), 2u);
  EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), std::vector<uint8_t>(other.begin(), other.end()));
  EXPECT_EQ(decode.calls, 2) << "the new version's entry was not used";
}

// A source rewritten in place with its old size and modification time
// (`cp -p` or `touch -r` onto it): its change time differs, so it is decoded
// again instead of being served the old entry.
TEST(DecodedCache, SameSizeRewriteWithItsOldMtimeIsDecodedAgain) {
  const std::string dir = FreshDir("decoded_ctime");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({4, 2}, Pixels(8)));
  struct stat before;
  ASSERT_EQ(::stat(src.c_str(), &before), 0);
  CountingDecode decode{src};
  LoadDecoded(src, std::ref(decode), 0);
  // Past the kernel's coarse timestamp tick, so that the change time moves.
  ::usleep(30000);
  std::string other = Pixels(8);
  other[0] = 'z';
  WriteFile(src, IdxBytes({4, 2}, other));  // the same inode, truncated and rewritten
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, src.c_str(), times, 0), 0);
  struct stat after;
  ASSERT_EQ(::stat(src.c_str(), &after), 0);
  ASSERT_EQ(after.st_ino, before.st_ino);
  ASSERT_EQ(after.st_size, before.st_size);
  const SharedArray now = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 2) << "the entry of the old contents was used";
  EXPECT_EQ(Bytes(now), std::vector<uint8_t>(other.begin(), other.end()));
}

// A source replaced while it is decoded: the bytes decoded may be either
// file's, so no entry is written (one would pair the old file's identity with
// the new file's contents); the next load decodes and writes one.
TEST(DecodedCache, SourceReplacedDuringTheDecodeWritesNoEntry) {
  const std::string dir = FreshDir("decoded_replaced");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({4, 2}, Pixels(8)));
  std::string other = Pixels(12);
  other[0] = 'z';
  CountingDecode reader{src};
  auto replacing = [&] {
    WriteFile(dir + "/new", IdxBytes({4, 3}, other));
    std::filesystem::rename(dir + "/new", src);
    return reader();
  };
  const SharedArray first = LoadDecoded(src, replacing, 0);
  EXPECT_EQ(Bytes(first), std::vector<uint8_t>(other.begin(), other.end()));
  EXPECT_TRUE(Entries(dir + "/cache").empty()) << "an entry was written for a source replaced during its decode";
  CountingDecode decode{src};
  LoadDecoded(src, std::ref(decode), 0);
  const SharedArray third = LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 1) << "the second load wrote no entry";
  EXPECT_EQ(Bytes(third), std::vector<uint8_t>(other.begin(), other.end()));
}

// An entry of several sources (CIFAR-10's five batches) is keyed by all of
// them: a change to any one decodes again.
TEST(DecodedCache, SeveralSourcesAreAllPartOfTheKey) {
  const std::string dir = FreshDir("decoded_sources");
  const CacheDir cache(dir + "/cache");
  const std::vector<std::string> sources = {dir + "/a", dir + "/b"};
  WriteFile(sources[0], "first");
  WriteFile(sources[1], "second");
  int calls = 0;
  auto decode = [&] {
    ++calls;
    return std::make_pair(std::vector<int64_t>{4}, std::vector<uint8_t>{1, 2, 3, static_cast<uint8_t>(calls)});
  };
  LoadDecoded(sources, decode, 0);
  EXPECT_EQ(LoadDecoded(sources, decode, 0).data[3], 1);
  EXPECT_EQ(calls, 1);
  // The same first source alone is another entry.
  LoadDecoded(sources[0], decode, 0);
  EXPECT_EQ(calls, 2);
  WriteFile(sources[1], "changed");  // another size
  EXPECT_EQ(LoadDecoded(sources, decode, 0).data[3], 3);
  EXPECT_EQ(calls, 3);
  // The pair's old version is left to eviction beside the new one.
  EXPECT_EQ(Entries(dir + "/cache").size(), 3u);
  EXPECT_EQ(LoadDecoded(sources, decode, 0).data[3], 3);
  EXPECT_EQ(calls, 3) << "the new version's entry was not used";
}

// CIFAR-10 through the cache: a second load maps the entry and gives the
// same pixels and labels.
TEST(DecodedCache, CifarLoadsShareTheEntry) {
  const std::string dir = FreshDir("decoded_cifar");
  const CacheDir cache(dir + "/cache");
  constexpr int64_t kRecords = 350;  // x 3073 bytes: just over 1 MiB
  std::string batch(kRecords * kCifarRecordBytes, '\0');
  for (int64_t r = 0; r < kRecords; ++r) {
    batch[r * kCifarRecordBytes] = static_cast<char>(r % 10);
    for (int64_t p = 1; p < kCifarRecordBytes; ++p) batch[r * kCifarRecordBytes + p] = static_cast<char>(r * 31 + p);
  }
  WriteFile(dir + "/test_batch.bin", batch);
  const auto a = LoadCifar10(dir, Split::kTest);
  EXPECT_EQ(Entries(dir + "/cache").size(), 1u);
  const auto b = LoadCifar10(dir, Split::kTest);
  ASSERT_EQ(b->Size(), kRecords);
  for (int64_t r : {int64_t{0}, int64_t{123}, kRecords - 1}) {
    EXPECT_EQ(b->Label(r), r % 10);
    EXPECT_EQ(std::vector<uint8_t>(a->Pixels(r), a->Pixels(r) + 3072), std::vector<uint8_t>(b->Pixels(r), b->Pixels(r) + 3072));
    EXPECT_EQ(b->Pixels(r)[5], static_cast<uint8_t>(r * 31 + 6));
  }
}

// How a child ended, from its wait status: "exited with 1", "died of
// signal 6 (Aborted)".
std::string HowItEnded(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "died of signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

// Ranks load at once into an empty cache: every one gets the right bytes,
// and one whole entry is left, with no temporary files.
TEST(DecodedCache, ConcurrentFirstLoadsLeaveOneWholeEntry) {
  const std::string dir = FreshDir("decoded_concurrent");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images.gz";
  const std::vector<uint8_t> want = Want(3 << 20);
  WriteFile(src, Gzip(IdxBytes({3, 1024, 1024}, Pixels(3 << 20))));
  std::vector<pid_t> children;
  for (int i = 0; i < 4; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;  // the children already started are still reaped below
    }
    if (pid == 0) {
      int ok = 0;
      for (int round = 0; round < 3; ++round) {
        CountingDecode decode{src};
        const SharedArray a = LoadDecoded(src, std::ref(decode), 0);
        ok += a.size == want.size() && std::equal(a.data, a.data + a.size, want.begin());
      }
      ::_exit(ok == 3 ? 0 : 1);
    }
    children.push_back(pid);
  }
  const auto until = std::chrono::steady_clock::now() + kChildDeadline;
  for (pid_t pid : children) {
    const int status = WaitChild(pid, until);
    if (status == -1) continue;  // killed at the deadline: WaitChild has said so
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "child " << pid << " " << HowItEnded(status) << "; an exit with 1 means it read wrong bytes";
  }
  ASSERT_EQ(children.size(), 4u);
  const auto entries = Entries(dir + "/cache");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].extension(), ".decoded");
  CountingDecode decode{src};
  EXPECT_TRUE(Bytes(LoadDecoded(src, std::ref(decode), 0)) == want);
  EXPECT_EQ(decode.calls, 0);
}

// Writes one byte to `path` (O_APPEND): a decode's mark that processes
// share.
void Mark(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || ::write(fd, "d", 1) != 1) ::_exit(4);
  ::close(fd);
}

// Ranks load one set at once into a cold cache: one decodes and writes the
// entry while the others wait for it and map it, instead of each decoding and
// writing (and fsyncing) a whole entry of its own.
TEST(DecodedCache, ConcurrentFirstLoadsDecodeOnce) {
  const std::string dir = FreshDir("decoded_once");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images.gz";
  const std::string marks = dir + "/decodes";
  const std::vector<uint8_t> want = Want(1 << 20);
  WriteFile(src, Gzip(IdxBytes({1, 1024, 1024}, Pixels(1 << 20))));
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  std::vector<pid_t> children;
  for (int i = 0; i < 4; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;  // the children already started are let go and reaped below
    }
    if (pid == 0) {
      ::close(go[1]);
      char c;
      if (::read(go[0], &c, 1) != 0) ::_exit(5);  // all start when the parent closes its end
      auto slow = [&] {
        Mark(marks);
        ::usleep(300000);  // a decode long enough for every rank to find no entry
        IdxArray a = ReadIdxFile(src);
        return std::make_pair(a.dims, a.data);
      };
      const SharedArray a = LoadDecoded(src, slow, 0);
      ::_exit(a.size == want.size() && std::equal(a.data, a.data + a.size, want.begin()) ? 0 : 1);
    }
    children.push_back(pid);
  }
  ::close(go[0]);
  ::close(go[1]);
  const auto until = std::chrono::steady_clock::now() + kChildDeadline;
  for (pid_t pid : children) {
    const int status = WaitChild(pid, until);
    if (status == -1) continue;  // killed at the deadline: WaitChild has said so
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "child " << pid << " " << HowItEnded(status)
        << "; an exit with 1 means it read wrong bytes, 4 that it could not mark its decode, 5 that its go "
           "pipe did not end as it should";
  }
  ASSERT_EQ(children.size(), 4u);
  EXPECT_EQ(std::filesystem::file_size(marks), 1u) << "the set was decoded once per process";
  const auto entries = Entries(dir + "/cache");
  ASSERT_EQ(entries.size(), 1u) << "a lock file or a temporary was left";
  EXPECT_EQ(entries[0].extension(), ".decoded");
}

// A process holding the entry's lock past the wait (a stuck writer) is not
// waited for: the other load decodes alone and writes nothing, and the
// holder's entry is the one left.
TEST(DecodedCache, AWriterPastTheWaitIsNotWaitedFor) {
  const std::string dir = FreshDir("decoded_stuck");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({4, 2}, Pixels(8)));
  int decoding[2], release[2];
  ASSERT_EQ(::pipe(decoding), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(decoding[0]);
    ::close(release[1]);
    // Stuck until the parent's load is over (its end of `release` closed),
    // or 2 s at most: a load that waited for this writer takes that long.
    auto stuck = [&] {
      if (::write(decoding[1], "d", 1) != 1) ::_exit(5);
      pollfd released{release[0], POLLIN, 0};
      if (::poll(&released, 1, 2000) < 0) ::_exit(6);
      IdxArray a = ReadIdxFile(src);
      return std::make_pair(a.dims, a.data);
    };
    ::_exit(LoadDecoded(src, stuck, 0).size == 8 ? 0 : 1);
  }
  ChildReaper child(pid);  // a return or an exception before the wait below kills and reaps it
  ::close(decoding[1]);
  ::close(release[0]);
  const bool started = ReadByteWithin(decoding[0], kHandshakeDeadline);
  ::close(decoding[0]);
  if (!started) {
    ::close(release[1]);
    FAIL() << "the child did not start decoding";
  }
  CountingDecode decode{src};
  const auto start = std::chrono::steady_clock::now();
  const SharedArray a = LoadDecoded(src, std::ref(decode), 0, std::chrono::milliseconds(100));
  const auto took = std::chrono::steady_clock::now() - start;
  ::close(release[1]);
  EXPECT_LT(took, std::chrono::milliseconds(1500)) << "it waited for the writer";
  EXPECT_EQ(decode.calls, 1);
  EXPECT_EQ(Bytes(a), Want(8));
  const int status = WaitChild(child.Release(), kChildDeadline);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const auto entries = Entries(dir + "/cache");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].extension(), ".decoded");
  LoadDecoded(src, std::ref(decode), 0);
  EXPECT_EQ(decode.calls, 1) << "the writer's entry was not used";
}

// A container restarted under another host name, played by a child in a
// UTS namespace of its own: it maps the entry written before (the entry's
// name hashed the host name, so on a persistent volume every restart
// decoded the set again and wrote another entry).
TEST(DecodedCache, AnotherHostNameMapsTheEntryOfTheSameFiles) {
  const std::string dir = FreshDir("decoded_restarted");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images.gz";
  WriteFile(src, Gzip(IdxBytes({5, 4, 3}, Pixels(60))));
  CountingDecode decode{src};
  LoadDecoded(src, std::ref(decode), 0);
  ASSERT_EQ(Entries(dir + "/cache").size(), 1u);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Needs root (CAP_SYS_ADMIN), as the other namespace tests here.
    if (::unshare(CLONE_NEWUTS) != 0 || ::sethostname("restarted-host", 14) != 0) ::_exit(2);
    CountingDecode restarted{src};
    const SharedArray a = LoadDecoded(src, std::ref(restarted), 0);
    ::_exit(Bytes(a) != Want(60) ? 1 : restarted.calls == 0 ? 0 : 4);
  }
  const int status = WaitChild(pid, kChildDeadline);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit";
  ASSERT_NE(WEXITSTATUS(status), 2) << "unshare(CLONE_NEWUTS) or sethostname failed (this test needs root)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child read wrong bytes (1) or decoded again (4)";
  EXPECT_EQ(Entries(dir + "/cache").size(), 1u) << "the child wrote an entry of its own";
}

// A container restarted on the same image, played by a child in a mount
// namespace of its own that mounts an overlay of the set's folder, loads
// it, then mounts another overlay of it on the same place: the same files,
// inodes and times at the same path, under another device number (as an
// overlay or NFS mount gets at each mount). It maps the entry the first
// mount's load wrote; the entry's name hashed the device number, so every
// restart decoded the set again and wrote another entry.
TEST(DecodedCache, AnotherMountOfTheSameFilesMapsTheirEntry) {
  const std::string dir = FreshDir("decoded_overlay");
  const CacheDir cache(dir + "/cache");
  const std::string lower = dir + "/lower", empty = dir + "/empty", root = dir + "/root";
  for (const std::string& d : {lower, empty, root}) ASSERT_EQ(::mkdir(d.c_str(), 0755), 0) << d;
  WriteFile(lower + "/images.gz", Gzip(IdxBytes({5, 4, 3}, Pixels(60))));
  const std::string src = root + "/images.gz";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Needs root (CAP_SYS_ADMIN) and overlayfs. The root made private
    // first, so that the mounts stay in the child's namespace; two lower
    // folders, as an overlay without an upper one needs.
    const std::string options = "lowerdir=" + lower + ":" + empty;
    const auto mount_overlay = [&] {
      return ::mount("overlay", root.c_str(), "overlay", MS_RDONLY, options.c_str()) == 0;
    };
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        !mount_overlay()) {
      ::_exit(2);
    }
    struct stat first{}, second{};
    CountingDecode decode{src};
    if (::stat(src.c_str(), &first) != 0 || Bytes(LoadDecoded(src, std::ref(decode), 0)) != Want(60)) ::_exit(1);
    if (!mount_overlay()) ::_exit(2);
    if (::stat(src.c_str(), &second) != 0 || second.st_dev == first.st_dev || second.st_ino != first.st_ino) {
      ::_exit(3);
    }
    if (Bytes(LoadDecoded(src, std::ref(decode), 0)) != Want(60)) ::_exit(1);
    ::_exit(decode.calls == 1 ? 0 : 4);
  }
  const int status = WaitChild(pid, kChildDeadline);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit";
  ASSERT_NE(WEXITSTATUS(status), 2) << "unshare or an overlay mount failed (this test needs root and overlayfs)";
  ASSERT_NE(WEXITSTATUS(status), 3) << "the second overlay did not show the file under another device number";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child read wrong bytes (1) or decoded again under the second mount (4)";
  EXPECT_EQ(Entries(dir + "/cache").size(), 1u) << "the second mount's load wrote an entry of its own";
}

// Another host sharing the cache folder (a home directory on NFS), with its
// own copy of the set at the same path, played by a child in UTS and mount
// namespaces of its own, another file bind-mounted over the source: it
// decodes its copy and keeps an entry of its own beside this host's instead
// of being served this host's or replacing it (an entry is valid for the
// source files' inodes, so the two would replace each other at every load,
// under ranks that had them mapped).
TEST(DecodedCache, AnotherHostsCopyAtTheSamePathKeepsAnEntryOfItsOwn) {
  const std::string dir = FreshDir("decoded_hosts");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images.gz", other_copy = dir + "/other_images.gz";
  WriteFile(src, Gzip(IdxBytes({5, 4, 3}, Pixels(60))));
  std::string other = Pixels(60);
  std::reverse(other.begin(), other.end());
  WriteFile(other_copy, Gzip(IdxBytes({5, 4, 3}, other)));
  CountingDecode decode{src};
  LoadDecoded(src, std::ref(decode), 0);
  ASSERT_EQ(Entries(dir + "/cache").size(), 1u);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Needs root (CAP_SYS_ADMIN). The root made private first, so that the
    // bind mount stays in the child's namespace.
    if (::unshare(CLONE_NEWUTS | CLONE_NEWNS) != 0 || ::sethostname("another-host", 12) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount(other_copy.c_str(), src.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      ::_exit(2);
    }
    CountingDecode other_host{src};
    const std::vector<uint8_t> want(other.begin(), other.end());
    const bool right = Bytes(LoadDecoded(src, std::ref(other_host), 0)) == want &&
                       Bytes(LoadDecoded(src, std::ref(other_host), 0)) == want;
    ::_exit(!right ? 1 : other_host.calls == 1 ? 0 : 4);
  }
  const int status = WaitChild(pid, kChildDeadline);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit";
  ASSERT_NE(WEXITSTATUS(status), 2) << "unshare, sethostname or the bind mount failed (this test needs root)";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "the other host was served this host's entry (1) or did not map its own the second time (4)";
  EXPECT_EQ(Entries(dir + "/cache").size(), 2u) << "the other host's entry replaced this host's";
  EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(60));
  EXPECT_EQ(decode.calls, 1) << "this host's entry was replaced";
}

TEST(DecodedCache, UnwritableFolderAndOffDecodeEveryTime) {
  const std::string dir = FreshDir("decoded_unwritable");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  {
    // A regular file where the folder should be.
    WriteFile(dir + "/blocked", "x");
    const CacheDir cache(dir + "/blocked/cache");
    CountingDecode decode{src};
    EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(9));
    LoadDecoded(src, std::ref(decode), 0);
    EXPECT_EQ(decode.calls, 2);
  }
  {
    const CacheDir cache("off");
    EXPECT_EQ(DecodedCacheDir(), "");
    CountingDecode decode{src};
    LoadDecoded(src, std::ref(decode), 0);
    LoadDecoded(src, std::ref(decode), 0);
    EXPECT_EQ(decode.calls, 2);
  }
}

// A set too small to cache, loaded with the cache in folders that do not
// exist yet, leaves none of them (nor a lock file): every test's scratch set
// made the cache folder in the user's home.
TEST(DecodedCache, ASetTooSmallToCacheMakesNoFolder) {
  const std::string dir = FreshDir("decoded_tiny");
  const CacheDir cache(dir + "/made/cache");
  CountingDecode decode{dir + "/images"};
  WriteFile(decode.path, IdxBytes({3, 3}, Pixels(9)));
  EXPECT_EQ(Bytes(LoadDecoded(decode.path, std::ref(decode))), Want(9));
  EXPECT_FALSE(std::filesystem::exists(dir + "/made")) << "the load made the cache folder for a set it does not cache";
}

// The changes to one folder's listing (a file or folder made, removed or
// renamed in it, the folder's own attributes) from its making to a call of
// Changes, through inotify: a lock file made and removed at once leaves no
// trace in the listing, and may leave the folder's times as they were.
class FolderWatch {
 public:
  explicit FolderWatch(const std::string& dir) : fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) {
    if (fd_ < 0 || ::inotify_add_watch(fd_, dir.c_str(),
                                       IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB) < 0) {
      ADD_FAILURE() << "cannot watch " << dir << ": " << std::strerror(errno);
    }
  }
  ~FolderWatch() {
    if (fd_ >= 0) ::close(fd_);
  }
  FolderWatch(const FolderWatch&) = delete;
  FolderWatch& operator=(const FolderWatch&) = delete;

  /// The names the changes since the last call were about ("." for the folder itself).
  std::vector<std::string> Changes() {
    std::vector<std::string> out;
    alignas(struct inotify_event) char buf[4096];
    for (ssize_t n; fd_ >= 0 && (n = ::read(fd_, buf, sizeof(buf))) > 0;) {
      for (ssize_t at = 0; at < n;) {
        const auto* e = reinterpret_cast<const struct inotify_event*>(buf + at);
        out.push_back(e->len > 0 ? std::string(e->name) : std::string("."));
        at += static_cast<ssize_t>(sizeof(struct inotify_event) + e->len);
      }
    }
    return out;
  }

 private:
  int fd_;
};

std::string Joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// Runs `load` (a load of a set too small to cache) twice: with the cache
// in an existing folder under `dir`, which it must leave as it was (no
// change seen, its modification time kept, no entry), and with the cache
// in a folder that does not exist, which it must not make (nor remove).
template <typename Load>
void ExpectLoadLeavesCacheFoldersAlone(const std::string& dir, const Load& load) {
  {
    const std::string cache_dir = dir + "/cache";
    std::filesystem::create_directories(cache_dir);
    struct stat before{}, after{};
    ASSERT_EQ(::stat(cache_dir.c_str(), &before), 0);
    const CacheDir cache(cache_dir);
    FolderWatch watch(cache_dir);
    load();
    EXPECT_EQ(Joined(watch.Changes()), "") << "the load changed " << cache_dir << " for a set it does not cache";
    ASSERT_EQ(::stat(cache_dir.c_str(), &after), 0);
    EXPECT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
    EXPECT_EQ(after.st_mtim.tv_sec, before.st_mtim.tv_sec);
    EXPECT_TRUE(Entries(cache_dir).empty());
  }
  {
    const CacheDir cache(dir + "/missing/cache");
    FolderWatch watch(dir);
    load();
    EXPECT_EQ(Joined(watch.Changes()), "") << "the load made and removed folders in " << dir;
    EXPECT_FALSE(std::filesystem::exists(dir + "/missing"));
  }
}

// A data set that its IDX header shows too small to cache leaves the cache
// folder as it was, whether its images are compressed or not: no lock file
// made and removed during the decode (each changed the folder's times and
// woke its watchers), and a folder that did not exist is not made (and
// removed). A set large enough, by the same header, still gets its entry.
TEST(DecodedCache, AnIdxSetTooSmallToCacheLeavesTheCacheFolderAlone) {
  const std::string dir = FreshDir("decoded_alone");
  const std::string labels = dir + "/labels";
  WriteFile(labels, IdxBytes({3}, std::string("\0\1\2", 3)));
  for (const bool gz : {false, true}) {
    SCOPED_TRACE(gz ? "gzip-compressed images" : "raw images");
    const std::string images = dir + (gz ? "/images.gz" : "/images");
    const std::string idx = IdxBytes({3, 3, 3}, Pixels(27));
    WriteFile(images, gz ? Gzip(idx) : idx);
    ExpectLoadLeavesCacheFoldersAlone(dir, [&] { EXPECT_EQ(LoadIdxDataset("tiny", images, labels, 10)->Size(), 3); });
  }
  // 1 MiB and 1 KiB of pixels, at least kMinCachedBytes, so cached; bytes
  // that do not compress, so that the gzip file too is longer than what
  // the header is looked for in.
  const std::string big_labels = dir + "/big_labels";
  WriteFile(big_labels, IdxBytes({1025}, std::string(1025, '\1')));
  std::string noise(1025 * 1024, '\0');
  uint32_t x = 12345;
  for (char& c : noise) c = static_cast<char>((x = x * 1664525u + 1013904223u) >> 24);
  for (const bool gz : {false, true}) {
    const std::string big = dir + (gz ? "/big_images.gz" : "/big_images");
    const std::string idx = IdxBytes({1025, 32, 32}, noise);
    WriteFile(big, gz ? Gzip(idx) : idx);
    const std::string cache_dir = dir + (gz ? "/big_gz_cache" : "/big_cache");
    const CacheDir cache(cache_dir);
    LoadIdxDataset("big", big, big_labels, 10);
    EXPECT_EQ(Entries(cache_dir).size(), 1u) << "a set of " << noise.size() << " bytes was not cached from " << big;
  }
}

// CIFAR-10 records (label, then 3072 pixel bytes) `first` to `first + n - 1`:
// pixels that do not compress when `noise`, else a repeating pattern.
std::string CifarRecords(int64_t first, int64_t n, bool noise) {
  std::string out(n * kCifarRecordBytes, '\0');
  uint32_t x = static_cast<uint32_t>(first) * 2654435761u + 1;
  for (int64_t r = 0; r < n; ++r) {
    out[r * kCifarRecordBytes] = static_cast<char>((first + r) % 10);
    for (int64_t p = 1; p < kCifarRecordBytes; ++p) {
      out[r * kCifarRecordBytes + p] =
          static_cast<char>(noise ? (x = x * 1664525u + 1013904223u) >> 24 : (first + r) * 31 + p);
    }
  }
  return out;
}

// A CIFAR-10 set that its files' sizes show too small to cache leaves the
// cache folder as it was, its batch compressed or not (each load made and
// removed a lock file there, and made and removed a missing folder); so
// does a compressed one whose trailer would let a larger set pass for
// small (zeros padded after it). A set large enough still gets its entry:
// raw, compressed, and compressed in two members of which the last, the
// one the trailer tells of, is small.
TEST(DecodedCache, ACifarSetTooSmallToCacheLeavesTheCacheFolderAlone) {
  const std::string dir = FreshDir("decoded_cifar_alone");
  const std::string tiny = CifarRecords(0, 3, /*noise=*/true);
  const std::vector<std::pair<const char*, std::string>> small_batches = {
      {"raw", tiny}, {"gzip", Gzip(tiny)}, {"gzip padded with zeros", Gzip(tiny) + std::string(64, '\0')}};
  int small_number = 0;
  for (const auto& [kind, batch] : small_batches) {
    SCOPED_TRACE(kind);
    const std::string data = FreshDir("decoded_cifar_small_" + std::to_string(small_number++));
    WriteFile(data + "/test_batch.bin", batch);
    ExpectLoadLeavesCacheFoldersAlone(dir, [&] {
      const auto set = LoadCifar10(data, Split::kTest);
      ASSERT_EQ(set->Size(), 3);
      EXPECT_EQ(set->Label(2), 2);
      EXPECT_EQ(set->Pixels(1)[7], static_cast<uint8_t>(tiny[kCifarRecordBytes + 8]));
    });
  }
  // 342 records: 1,050,966 bytes decoded, at least kMinCachedBytes.
  constexpr int64_t kRecords = 342;
  static_assert(kRecords * kCifarRecordBytes >= static_cast<int64_t>(kMinCachedBytes));
  const std::string big = CifarRecords(0, kRecords, /*noise=*/true);
  const std::string pattern = CifarRecords(0, kRecords, /*noise=*/false);
  const std::vector<std::pair<const char*, std::string>> big_batches = {
      {"raw", big},
      {"gzip", Gzip(big)},
      {"gzip of a compressible set", Gzip(pattern)},
      {"gzip in two members, the last small",
       Gzip(pattern.substr(0, (kRecords - 2) * kCifarRecordBytes)) +
           Gzip(pattern.substr((kRecords - 2) * kCifarRecordBytes))}};
  int case_number = 0;
  for (const auto& [kind, batch] : big_batches) {
    SCOPED_TRACE(kind);
    const std::string data = FreshDir("decoded_cifar_big_" + std::to_string(case_number));
    const std::string cache_dir = dir + "/big_cache_" + std::to_string(case_number++);
    WriteFile(data + "/test_batch.bin", batch);
    const CacheDir cache(cache_dir);
    const auto set = LoadCifar10(data, Split::kTest);
    ASSERT_EQ(set->Size(), kRecords);
    EXPECT_EQ(set->Label(kRecords - 1), (kRecords - 1) % 10);
    EXPECT_EQ(Entries(cache_dir).size(), 1u) << "a set of " << big.size() << " bytes was not cached";
  }
}

// Sets an environment variable for a scope (unset: nullptr).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* was = std::getenv(name);
    had_ = was != nullptr;
    if (had_) was_ = was;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, was_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string was_;
};

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A cache that cannot be written says so once, with the entry's path and
// the cause, and loads go on decoding (a failed write was swallowed without
// a word): a folder that cannot be made, then a write that fails.
TEST(DecodedCache, AFailedWriteWarnsOnceNamingThePathAndTheCause) {
  const std::string dir = FreshDir("decoded_warn");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  WriteFile(dir + "/blocked", "x");
  {
    const CacheDir cache(dir + "/blocked/cache");
    ResetDecodedCacheWarningsForTesting();
    StderrCapture capture;
    CountingDecode decode{src};
    EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(9));
    EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(9));
    const std::string warned = capture.Take();
    EXPECT_EQ(decode.calls, 2);
    EXPECT_EQ(Count(warned, "warning: decoded dataset cache: cannot write " + dir + "/blocked/cache/images-"), 1u)
        << warned;
    EXPECT_NE(warned.find("Not a directory"), std::string::npos) << warned;
  }
  {
    // A folder where the entry should be: the atomic write fails.
    const std::string cache_dir = dir + "/cache";
    const CacheDir cache(cache_dir);
    CountingDecode decode{src};
    LoadDecoded(src, std::ref(decode), 0);
    const auto entries = Entries(cache_dir);
    ASSERT_EQ(entries.size(), 1u);
    std::filesystem::remove(entries[0]);
    std::filesystem::create_directory(entries[0]);
    ResetDecodedCacheWarningsForTesting();
    StderrCapture capture;
    EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(9));
    LoadDecoded(src, std::ref(decode), 0);
    const std::string warned = capture.Take();
    EXPECT_EQ(decode.calls, 3);
    EXPECT_EQ(Count(warned, "cannot write " + entries[0].string() + ": "), 1u) << warned;
  }
}

// Starts `body` in a child process whose flock calls a seccomp filter
// answers with ENOLCK, as NFS mounted without locks does. The child exits
// with what `body` returned, 2 when the filter could not be installed, 3
// when a flock of `probe` still did not fail so. Returns its pid (-1: no
// child).
pid_t StartWithoutLocks(const std::string& probe, const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
#if defined(__x86_64__)
    constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
    constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#else
#error "the seccomp filter below names no audit architecture for this CPU"
#endif
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_flock, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOLCK & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    const sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
      ::_exit(2);
    }
    const int fd = ::open(probe.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) == 0 || errno != ENOLCK) ::_exit(3);
    ::close(fd);
    ::_exit(body());
  }
  return pid;
}

// The exit status of child `pid` (-1 when there is none, or it did not
// exit: killed at kChildDeadline, the test failed then).
int ExitStatus(pid_t pid) {
  if (pid < 0) return -1;
  const int status = WaitChild(pid, kChildDeadline);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs `body` as StartWithoutLocks does and returns the child's exit status.
int InChildWithoutLocks(const std::string& probe, const std::function<int()>& body) {
  return ExitStatus(StartWithoutLocks(probe, body));
}

// The text of the file at `path` ("" when there is none).
std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Runs `body` in a child process with a mount namespace of its own (mounts
// made there go with it), its stderr captured into `stderr_file`. `mount`
// makes the child's mounts: the child exits with 2 when it fails (or the
// namespace cannot be made: this needs root), else with what `body`
// returned. Returns the exit status (-1 when the child did not exit).
int InChildWithMounts(const std::function<bool()>& mount, const std::string& stderr_file,
                      const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The root made private first, so that the mounts stay in the child's
    // namespace.
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        !mount()) {
      ::_exit(2);
    }
    ResetDecodedCacheWarningsForTesting();
    ::testing::internal::CaptureStderr();
    const int status = body();
    WriteFile(stderr_file, ::testing::internal::GetCapturedStderr());
    ::_exit(status);
  }
  return ExitStatus(pid);
}

// A cache folder on a full filesystem (a 64 KiB tmpfs, for a set of
// 256 KiB): each load gives the decoded bytes, nothing is left in the
// folder (no part of an entry, no lock file), and one warning names the
// entry and the cause, for the run's two loads together. No write is
// started: each one filled the disk to its last block before it failed,
// making any other file written then fail too.
TEST(DecodedCache, AFullDiskLeavesNothingHalfWrittenAndWarnsOnce) {
  const std::string dir = FreshDir("decoded_full");
  const std::string cache_dir = dir + "/cache";
  ASSERT_EQ(::mkdir(cache_dir.c_str(), 0755), 0);
  const CacheDir cache(cache_dir);
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({256, 1024}, Pixels(256 << 10)));
  const std::string stderr_file = dir + "/child_stderr", left_file = dir + "/left";
  // Exit statuses: 1 for wrong bytes, 4 for the wrong number of decodes,
  // 5 for files left in the cache folder (listed in `left_file`), 6 for a
  // write started.
  const int status = InChildWithMounts(
      [&] { return ::mount("tmpfs", cache_dir.c_str(), "tmpfs", 0, "size=64k") == 0; }, stderr_file, [&] {
        int writes = 0;
        io::internal::SetTemporaryCreatedHookForTesting([&](const std::string&) { ++writes; });
        CountingDecode decode{src};
        const bool right = Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(256 << 10) &&
                           Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(256 << 10);
        std::string left;
        for (const auto& e : Entries(cache_dir)) left += e.string() + "\n";
        WriteFile(left_file, left);
        return !right ? 1 : decode.calls != 2 ? 4 : !left.empty() ? 5 : writes != 0 ? 6 : 0;
      });
  ASSERT_NE(status, 2) << "unshare or the tmpfs mount failed (this test needs root)";
  EXPECT_EQ(status, 0) << "wrong bytes (1), decodes (4), files left on the full disk (5: " << ReadText(left_file)
                       << "), or a write started on a disk without room for the entry (6)";
  const std::string warned = ReadText(stderr_file);
  EXPECT_EQ(Count(warned, "[ddp] warning"), 1u) << warned;
  EXPECT_EQ(Count(warned, "warning: decoded dataset cache: cannot write " + cache_dir + "/images-"), 1u) << warned;
  EXPECT_NE(warned.find(std::strerror(ENOSPC)), std::string::npos) << warned;
}

// The set-up of the make-room scenarios below: a fresh empty cache folder
// (a tmpfs is mounted on it in the child) with no size limit, an earlier
// run's set (`old_set`, `old_kib` KiB of images) and this run's (`labels`,
// `new_kib` KiB).
struct MakeRoomScenario {
  MakeRoomScenario(const std::string& tag, uint32_t old_kib, uint32_t new_kib)
      : dir(FreshDir(tag)),
        cache_dir(dir + "/cache"),
        cache(cache_dir),
        old_set{dir + "/old_images"},
        labels{dir + "/labels"},
        stderr_file(dir + "/child_stderr"),
        left_file(dir + "/left") {
    EXPECT_EQ(::mkdir(cache_dir.c_str(), 0755), 0) << cache_dir;
    WriteFile(old_set.path, IdxBytes({old_kib, 1024}, Pixels(size_t{old_kib} << 10)));
    WriteFile(labels.path, IdxBytes({new_kib, 1024}, Pixels(size_t{new_kib} << 10)));
  }
  const std::string dir, cache_dir;
  const CacheDir cache;
  const ScopedEnv no_limit{"DDP_DATA_CACHE_MAX_BYTES", nullptr};
  CountingDecode old_set, labels;
  const std::string stderr_file, left_file;
};

// The end of the full-disk scenarios below, in the child: loads `set`
// twice (decoded once, then its entry mapped), lists the files left in
// `cache_dir` in `left_file`, one per line, and returns 0, or 1 for wrong
// bytes, 4 when the set was not decoded exactly once, 5 when the files left
// are not one per name prefix of `want_left`.
int LoadTwiceAndList(CountingDecode& set, size_t bytes, const std::string& cache_dir, const std::string& left_file,
                     const std::vector<std::string>& want_left) {
  const bool right = Bytes(LoadDecoded(set.path, std::ref(set), 0)) == Want(bytes) &&
                     Bytes(LoadDecoded(set.path, std::ref(set), 0)) == Want(bytes);
  std::string left;
  for (const auto& e : Entries(cache_dir)) left += e.filename().string() + "\n";
  WriteFile(left_file, left);
  bool as_wanted = Entries(cache_dir).size() == want_left.size();
  for (const std::string& prefix : want_left) as_wanted &= left.find(prefix) != std::string::npos;
  return !right ? 1 : set.calls != 1 ? 4 : !as_wanted ? 5 : 0;
}

// The parent's side of LoadTwiceAndList: the child returned 0 and warned
// nothing.
void ExpectLoadedTwiceWithoutAWarning(int status, const std::string& stderr_file, const std::string& left_file) {
  EXPECT_EQ(status, 0) << "wrong bytes (1), the set decoded again instead of mapped (4), or other files in the "
                          "folder than expected (5: "
                       << ReadText(left_file) << ")";
  EXPECT_EQ(ReadText(stderr_file), "") << "a warning";
}

// A cache folder on a disk with room for one entry (a 512 KiB tmpfs), full
// with an earlier run's entry of another set: writing this set's entry
// removes it to make room (the disk stayed full of entries no run used,
// and every run decoded the set again and warned), and the next load maps
// the new entry, without a warning.
TEST(DecodedCache, AFullDiskMakesRoomByRemovingTheLeastRecentlyUsedEntries) {
  MakeRoomScenario scenario("decoded_full_evict", 200, 400);
  auto& [dir, cache_dir, cache, no_limit, old_set, labels, stderr_file, left_file] = scenario;
  // Exit statuses: 1 for wrong bytes, 4 for the wrong number of decodes,
  // 5 for other files than the new entry in the folder (listed in
  // `left_file`), 6 when the earlier run's entry was not written.
  const int status = InChildWithMounts(
      [&] { return ::mount("tmpfs", cache_dir.c_str(), "tmpfs", 0, "size=512k") == 0; }, stderr_file, [&] {
        if (Bytes(LoadDecoded(old_set.path, std::ref(old_set), 0)) != Want(200 << 10)) return 1;
        if (Entries(cache_dir).size() != 1) return 6;
        ForgetDecodedEntriesInUseForTesting();  // the entry stands for an earlier run's
        return LoadTwiceAndList(labels, 400 << 10, cache_dir, left_file, {"labels-"});
      });
  ASSERT_NE(status, 2) << "unshare or the tmpfs mount failed (this test needs root)";
  ASSERT_NE(status, 6) << "the first set's entry was not written on the empty tmpfs";
  ExpectLoadedTwiceWithoutAWarning(status, stderr_file, left_file);
}

// A cache folder so full that not even the empty lock file fits (a tmpfs
// of 3 inodes: its root, an earlier run's entry of another set and a lock
// file left by a killed process): the load removes them to make room for
// its lock file and its entry, and the next load maps the entry, without a
// warning. The cache only warned there, so the disk stayed full and every
// run decoded the set again.
TEST(DecodedCache, NoRoomForTheLockFileMakesRoomByRemovingTheLeastRecentlyUsedEntries) {
  MakeRoomScenario scenario("decoded_full_lock", 10, 20);
  auto& [dir, cache_dir, cache, no_limit, old_set, labels, stderr_file, left_file] = scenario;
  // Exit statuses: 1 for wrong bytes, 4 for the wrong number of decodes,
  // 5 for other files than the new entry in the folder (listed in
  // `left_file`), 6 when the set-up did not fill the inodes.
  const int status = InChildWithMounts(
      [&] { return ::mount("tmpfs", cache_dir.c_str(), "tmpfs", 0, "size=1m,nr_inodes=3") == 0; }, stderr_file,
      [&] {
        if (Bytes(LoadDecoded(old_set.path, std::ref(old_set), 0)) != Want(10 << 10)) return 1;
        WriteFile(cache_dir + "/killed-0000000000000000.decoded.lock", "");
        const std::string probe = cache_dir + "/probe";
        const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0 || errno != ENOSPC) return 6;
        ForgetDecodedEntriesInUseForTesting();  // the entry stands for an earlier run's
        return LoadTwiceAndList(labels, 20 << 10, cache_dir, left_file, {"labels-"});
      });
  ASSERT_NE(status, 2) << "unshare or the tmpfs mount failed (this test needs root)";
  ASSERT_NE(status, 6) << "the tmpfs still had an inode free after the set-up";
  ExpectLoadedTwiceWithoutAWarning(status, stderr_file, left_file);
}

// A write that runs out of room although statvfs showed enough (another
// file took it between the look and the write, as a quota, which statvfs
// does not show, would refuse it all along): the least recently used
// entries make room and the write is tried again, so the next load maps
// the entry, without a warning. (EDQUOT itself cannot be made here: root
// is not held to quotas.)
TEST(DecodedCache, AWriteOutOfRoomMakesRoomAndIsTriedAgain) {
  MakeRoomScenario scenario("decoded_full_retry", 200, 200);
  auto& [dir, cache_dir, cache, no_limit, old_set, labels, stderr_file, left_file] = scenario;
  // Exit statuses: 1 for wrong bytes, 4 for the wrong number of decodes,
  // 5 for other files than the new entry and the filler in the folder
  // (listed in `left_file`), 6 when the filler could not be written.
  const int status = InChildWithMounts(
      [&] { return ::mount("tmpfs", cache_dir.c_str(), "tmpfs", 0, "size=512k") == 0; }, stderr_file, [&] {
        if (Bytes(LoadDecoded(old_set.path, std::ref(old_set), 0)) != Want(200 << 10)) return 1;
        ForgetDecodedEntriesInUseForTesting();  // the entry stands for an earlier run's
        // Once the first temporary is made (after the look at the free
        // space), another entry takes 250 of the ~310 KiB left.
        bool filled = false, filler_written = true;
        io::internal::SetTemporaryCreatedHookForTesting([&](const std::string&) {
          if (filled) return;
          filled = true;
          const std::string filler = cache_dir + "/filler-0000000000000000.decoded";
          FILE* f = std::fopen(filler.c_str(), "wb");
          const std::string bytes(250 << 10, 'x');
          filler_written = f != nullptr && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
          if (f != nullptr && std::fclose(f) != 0) filler_written = false;
        });
        const int loaded = LoadTwiceAndList(labels, 200 << 10, cache_dir, left_file, {"labels-", "filler-"});
        io::internal::SetTemporaryCreatedHookForTesting({});
        return filler_written ? loaded : 6;
      });
  ASSERT_NE(status, 2) << "unshare or the tmpfs mount failed (this test needs root)";
  ASSERT_NE(status, 6) << "the filler that takes the room could not be written";
  ExpectLoadedTwiceWithoutAWarning(status, stderr_file, left_file);
}

// An entry put in place whose folder's fsync then fails (a seccomp filter
// hands each fsync to a thread that answers EIO for a folder, during the
// first load) is used as written: kept as in use when the next set's write
// evicts every other entry (the limit is 0), and mapped by the next load;
// the warning says it was written and may not survive a crash. It said
// "cannot write", and the entry was evicted as another process's.
TEST(DecodedCache, AFailedFolderFsyncAfterTheEntryIsInPlaceKeepsItInUse) {
  const std::string dir = FreshDir("decoded_folder_fsync");
  const std::string cache_dir = dir + "/cache";
  ASSERT_EQ(::mkdir(cache_dir.c_str(), 0755), 0);
  const CacheDir cache(cache_dir);
  const ScopedEnv limit("DDP_DATA_CACHE_MAX_BYTES", "0");
  CountingDecode images{dir + "/images"}, labels{dir + "/labels"};
  WriteFile(images.path, IdxBytes({10, 8}, Pixels(80)));
  WriteFile(labels.path, IdxBytes({12, 8}, Pixels(96)));
  const std::string stderr_file = dir + "/child_stderr";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
#if defined(__x86_64__)
    constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
    constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#else
#error "the seccomp filter below names no audit architecture for this CPU"
#endif
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_fsync, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    const sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    // The thread that answers is made before the filter, which then holds
    // only for this (the main) thread; it shares the descriptors, so it
    // fstats the one fsync was given. It stops when the child exits, or
    // gives up after 20 s (within the parent's wait for the child): it then
    // closes the listener, so that the child's fsyncs from then on fail
    // (ENOSYS) instead of waiting for an answer for good.
    constexpr int kGaveUp = -2;
    std::atomic<int> listener{-1};
    std::atomic<bool> fail_folders{true};
    std::thread answer([&listener, &fail_folders] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      const auto give_up = [&listener] {
        const int fd = listener.exchange(kGaveUp);
        if (fd >= 0) ::close(fd);
      };
      while (listener.load() < 0) {
        if (std::chrono::steady_clock::now() > deadline) return give_up();
        ::usleep(1000);
      }
      while (std::chrono::steady_clock::now() < deadline) {
        pollfd p{listener.load(), POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        seccomp_notif req{};
        if (::ioctl(listener.load(), SECCOMP_IOCTL_NOTIF_RECV, &req) != 0) continue;
        seccomp_notif_resp resp{};
        resp.id = req.id;
        // By its /proc name, not fstat: the descriptor was opened by the
        // blocked thread with no ordering ThreadSanitizer can see, which
        // it reported as a race on the descriptor (--config=tsan).
        struct stat st{};
        const std::string fd_name = "/proc/self/fd/" + std::to_string(static_cast<int>(req.data.args[0]));
        if (fail_folders.load() && ::stat(fd_name.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
          resp.error = -EIO;
        } else {
          resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        }
        ::ioctl(listener.load(), SECCOMP_IOCTL_NOTIF_SEND, &resp);
      }
      give_up();
    });
    answer.detach();
    const int fd = ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                       ? -1
                       : static_cast<int>(::syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER,
                                                    SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog));
    if (fd < 0) ::_exit(2);
    int unset = -1;
    if (!listener.compare_exchange_strong(unset, fd)) ::_exit(6);  // the thread gave up already
    // Folders' fsyncs fail, files' pass.
    const int folder = ::open(cache_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const int file = ::open(images.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (folder < 0 || file < 0 || ::fsync(folder) == 0 || errno != EIO || ::fsync(file) != 0) ::_exit(3);
    ::close(folder);
    ::close(file);
    ResetDecodedCacheWarningsForTesting();
    ::testing::internal::CaptureStderr();
    bool right = Bytes(LoadDecoded(images.path, std::ref(images), 0)) == Want(80);
    fail_folders = false;
    right = right && Bytes(LoadDecoded(labels.path, std::ref(labels), 0)) == Want(96) &&
            Bytes(LoadDecoded(images.path, std::ref(images), 0)) == Want(80);
    const size_t entries = Entries(cache_dir).size();
    WriteFile(stderr_file, ::testing::internal::GetCapturedStderr());
    ::_exit(!right ? 1 : images.calls != 1 ? 4 : entries != 2 ? 5 : 0);
  }
  const int status = ExitStatus(pid);
  ASSERT_NE(status, 2) << "the seccomp filter could not be installed";
  ASSERT_NE(status, 3) << "the seccomp filter did not fail a folder's fsync alone";
  EXPECT_EQ(status, 0) << "wrong bytes (1), the entry evicted and decoded again (4), not both entries kept (5), "
                          "or the answering thread gave up before the filter was in place (6)";
  const std::string warned = ReadText(stderr_file);
  EXPECT_EQ(Count(warned, "cannot write"), 0u) << warned;
  EXPECT_EQ(Count(warned, "written and renamed into place, but it may not survive a crash"), 1u) << warned;
}

// A filesystem that reports no size (a tmpfs mounted with size=0 has no
// limit, and statvfs gives it zero blocks, zero free) is no full disk: the
// entry is written and the next load maps it.
TEST(DecodedCache, AFilesystemWithoutASizeIsWrittenTo) {
  const std::string dir = FreshDir("decoded_unsized");
  const std::string cache_dir = dir + "/cache";
  ASSERT_EQ(::mkdir(cache_dir.c_str(), 0755), 0);
  const CacheDir cache(cache_dir);
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({10, 8}, Pixels(80)));
  const std::string stderr_file = dir + "/child_stderr";
  // Exit statuses: 1 for wrong bytes, 3 when statvfs gives the tmpfs a
  // size, 4 when the second load decoded again.
  const int status = InChildWithMounts(
      [&] { return ::mount("tmpfs", cache_dir.c_str(), "tmpfs", 0, "size=0") == 0; }, stderr_file, [&] {
        struct statvfs fs{};
        if (::statvfs(cache_dir.c_str(), &fs) != 0 || fs.f_blocks != 0) return 3;
        CountingDecode decode{src};
        const bool right = Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(80) &&
                           Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(80);
        return !right ? 1 : decode.calls != 1 ? 4 : 0;
      });
  ASSERT_NE(status, 2) << "unshare or the tmpfs mount failed (this test needs root)";
  ASSERT_NE(status, 3) << "statvfs gave the unlimited tmpfs a size: this test shows nothing here";
  EXPECT_EQ(status, 0) << "wrong bytes (1), or no entry written (4)";
  EXPECT_EQ(ReadText(stderr_file), "") << "a warning";
}

// A cache folder mounted read-only (a shared cache filled beforehand): its
// entry is mapped, and a set without one is decoded at each load, with one
// warning naming the entry that could not be written and the cause.
TEST(DecodedCache, AReadOnlyCacheMapsItsEntriesAndDecodesTheRestWithOneWarning) {
  const std::string dir = FreshDir("decoded_read_only");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  CountingDecode images{dir + "/images"};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, images);
  ASSERT_FALSE(entry.empty());
  CountingDecode labels{dir + "/labels"};
  WriteFile(labels.path, IdxBytes({6, 2}, Pixels(12)));
  const std::string stderr_file = dir + "/child_stderr";
  // Exit statuses: 1 for wrong bytes, 4 for the wrong number of decodes.
  const int status = InChildWithMounts(
      [&] {
        return ::mount(cache_dir.c_str(), cache_dir.c_str(), nullptr, MS_BIND, nullptr) == 0 &&
               ::mount(nullptr, cache_dir.c_str(), nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY, nullptr) == 0;
      },
      stderr_file, [&] {
        const bool right = Bytes(LoadDecoded(images.path, std::ref(images), 0)) == Want(80) &&
                           Bytes(LoadDecoded(labels.path, std::ref(labels), 0)) == Want(12) &&
                           Bytes(LoadDecoded(labels.path, std::ref(labels), 0)) == Want(12);
        return !right ? 1 : images.calls != 1 || labels.calls != 2 ? 4 : 0;
      });
  ASSERT_NE(status, 2) << "unshare or the read-only bind mount failed (this test needs root)";
  EXPECT_EQ(status, 0) << "wrong bytes (1), or the entry not mapped or the other set not decoded each time (4)";
  const std::string warned = ReadText(stderr_file);
  EXPECT_EQ(Count(warned, "[ddp] warning"), 1u) << warned;
  EXPECT_EQ(Count(warned, "warning: decoded dataset cache: cannot write " + cache_dir + "/labels-"), 1u) << warned;
  EXPECT_NE(warned.find(std::strerror(EROFS)), std::string::npos) << warned;
  const auto left = Entries(cache_dir);
  ASSERT_EQ(left.size(), 1u) << "files other than the entry in the read-only folder";
  EXPECT_EQ(left[0], entry);
}

// A lock file that can be made but not locked (flock answers ENOLCK on NFS
// mounted without locks) makes concurrent first loads each decode: said
// once per process, with the lock file and the cause (it was silent). Two
// sets, each loaded into a cold cache, meet the lock failure twice.
TEST(DecodedCache, ALockFileThatCannotBeLockedWarnsOnceNamingItAndTheCause) {
  const std::string dir = FreshDir("decoded_nolock");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  const std::string images = dir + "/images", labels = dir + "/labels";
  WriteFile(images, IdxBytes({3, 3}, Pixels(9)));
  WriteFile(labels, IdxBytes({3, 2}, Pixels(6)));
  const std::string stderr_file = dir + "/child_stderr";
  const int status = InChildWithoutLocks(images, [&] {
    ResetDecodedCacheWarningsForTesting();
    ::testing::internal::CaptureStderr();
    CountingDecode decode_images{images}, decode_labels{labels};
    const bool right = Bytes(LoadDecoded(images, std::ref(decode_images), 0)) == Want(9) &&
                       Bytes(LoadDecoded(labels, std::ref(decode_labels), 0)) == Want(6);
    WriteFile(stderr_file, ::testing::internal::GetCapturedStderr());
    return right ? 0 : 1;
  });
  ASSERT_NE(status, 2) << "the seccomp filter could not be installed";
  ASSERT_NE(status, 3) << "the seccomp filter did not make flock fail with ENOLCK";
  EXPECT_EQ(status, 0) << "the loads gave wrong bytes";
  std::ifstream in(stderr_file);
  const std::string warned((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(Count(warned, "[ddp] warning"), 1u) << warned;
  EXPECT_EQ(Count(warned, "warning: decoded dataset cache: cannot lock " + cache_dir + "/images-"), 1u) << warned;
  EXPECT_NE(warned.find(".decoded.lock: " + std::string(std::strerror(ENOLCK))), std::string::npos) << warned;
}

// Where the lock file cannot be locked, the entry is written all the same,
// through the atomic writer as always (a rename puts it in place whole): no
// entry was written without the lock, so every load of every run decoded
// the set again and warned again. The second load, and the next run (a
// second child), map it without a word, and no lock file is left beside it.
TEST(DecodedCache, WithoutLocksTheEntryIsStillWrittenAndTheNextRunMapsIt) {
  const std::string dir = FreshDir("decoded_nolock_entry");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  // Exit statuses of the runs: 1 for wrong bytes, 4 for the wrong number of
  // decodes.
  const int first = InChildWithoutLocks(src, [&] {
    CountingDecode decode{src};
    const bool right = Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9) &&
                       Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9);
    return !right ? 1 : decode.calls == 1 ? 0 : 4;
  });
  ASSERT_NE(first, 2) << "the seccomp filter could not be installed";
  ASSERT_NE(first, 3) << "the seccomp filter did not make flock fail with ENOLCK";
  EXPECT_EQ(first, 0) << "the first run gave wrong bytes (1) or its second load decoded again (4)";
  const auto entries = Entries(cache_dir);
  ASSERT_EQ(entries.size(), 1u) << "no entry, or a lock file or a temporary beside it";
  EXPECT_EQ(entries[0].extension(), ".decoded");
  const std::string stderr_file = dir + "/second_run_stderr";
  const int second = InChildWithoutLocks(src, [&] {
    ResetDecodedCacheWarningsForTesting();
    ::testing::internal::CaptureStderr();
    CountingDecode decode{src};
    const bool right = Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9);
    WriteFile(stderr_file, ::testing::internal::GetCapturedStderr());
    return !right ? 1 : decode.calls == 0 ? 0 : 4;
  });
  EXPECT_EQ(second, 0) << "the next run gave wrong bytes (1) or decoded again (4)";
  std::ifstream in(stderr_file);
  const std::string warned((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(warned, "") << "the next run warned";
}

// A process killed while it decoded (SIGKILL: no destructor runs) leaves
// its `<entry>.lock`, and nothing removed it: a set not loaded again kept an
// empty lock file in the cache forever. The next entry written removes the
// lock files no process holds, and leaves one that is held, and a file of
// that name that is no lock file (not empty).
TEST(DecodedCache, LockFilesNoOneHoldsAreRemovedAtTheNextWrite) {
  const std::string dir = FreshDir("decoded_stale_lock");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  const std::string killed_src = dir + "/killed_images", src = dir + "/images";
  WriteFile(killed_src, IdxBytes({3, 3}, Pixels(9)));
  WriteFile(src, IdxBytes({4, 2}, Pixels(8)));
  int decoding[2];
  ASSERT_EQ(::pipe(decoding), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(decoding[0]);
    auto killed = [&]() -> std::pair<std::vector<int64_t>, std::vector<uint8_t>> {
      if (::write(decoding[1], "d", 1) != 1) ::_exit(5);
      ::sleep(60);  // killed long before
      ::_exit(6);
    };
    LoadDecoded(killed_src, killed, 0);
    ::_exit(7);
  }
  ::close(decoding[1]);
  const bool started = ReadByteWithin(decoding[0], kHandshakeDeadline);
  ::close(decoding[0]);
  ::kill(pid, SIGKILL);
  const int status = WaitChild(pid, kChildDeadline);
  ASSERT_TRUE(started) << "the child did not start decoding (exit status " << status << ")";
  const auto left = Entries(cache_dir);
  ASSERT_EQ(left.size(), 1u);
  const std::string killed_lock = left[0].string();
  ASSERT_EQ(killed_lock.substr(killed_lock.size() - 13), ".decoded.lock") << killed_lock;
  // Held by this process through a descriptor of its own: the load's probe
  // opens another, and flock locks conflict between descriptions.
  const std::string held = cache_dir + "/held-0123456789abcdef.decoded.lock";
  const int held_fd = ::open(held.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(held_fd, 0);
  ASSERT_EQ(::flock(held_fd, LOCK_EX | LOCK_NB), 0);
  const std::string not_a_lock = cache_dir + "/notes.decoded.lock";
  WriteFile(not_a_lock, "kept by hand");
  CountingDecode decode{src};
  EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(8));
  EXPECT_FALSE(std::filesystem::exists(killed_lock)) << "the killed process's lock file was left";
  EXPECT_TRUE(std::filesystem::exists(held)) << "a lock file in use was removed";
  EXPECT_TRUE(std::filesystem::exists(not_a_lock)) << "a file that is not a lock file was removed";
  ::close(held_fd);
}

// A job whose loads all find their entries writes none, so the removal at
// the next write never came and lock files no process held stayed. A load
// from an entry removes them too, with the same care: a held one and a
// non-empty file of that name are left.
TEST(DecodedCache, LockFilesNoOneHoldsAreRemovedByALoadFromAnEntry) {
  const std::string dir = FreshDir("decoded_stale_lock_hit");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  CountingDecode decode{dir + "/images"};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  // What a process killed while decoding another set leaves: an empty file
  // that no one holds.
  const std::string stale = cache_dir + "/killed-0123456789abcdef.decoded.lock";
  WriteFile(stale, "");
  // Held by this process through a descriptor of its own (flock locks
  // conflict between open file descriptions).
  const std::string held = cache_dir + "/held-0123456789abcdef.decoded.lock";
  const int held_fd = ::open(held.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(held_fd, 0);
  ASSERT_EQ(::flock(held_fd, LOCK_EX | LOCK_NB), 0);
  const std::string not_a_lock = cache_dir + "/notes.decoded.lock";
  WriteFile(not_a_lock, "kept by hand");
  EXPECT_EQ(Bytes(LoadDecoded(decode.path, std::ref(decode), 0)), Want(80));
  EXPECT_EQ(decode.calls, 1) << "the second load did not map the entry";
  EXPECT_FALSE(std::filesystem::exists(stale)) << "a lock file no one holds was left by the load from the entry";
  EXPECT_TRUE(std::filesystem::exists(held)) << "a lock file in use was removed";
  EXPECT_TRUE(std::filesystem::exists(not_a_lock)) << "a file that is not a lock file was removed";
  EXPECT_TRUE(std::filesystem::exists(entry));
  ::close(held_fd);
}

// Runs `body` in a child process, its stderr into `stderr_file`, after
// ResetDecodedCacheWarningsForTesting (but with the reports to started
// ranks, DDP_DATA_CACHE_REPORTED and DDP_DATA_CACHE_LOCK_REPORTED, it
// inherited) and then with the variables `env`
// set (nullptr: unset). Returns the child's exit status (9: no stderr file).
int InChildWithEnv(const std::vector<std::pair<const char*, const char*>>& env, const std::string& stderr_file,
                   const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || ::dup2(fd, 2) < 0) ::_exit(9);
    std::vector<std::pair<const char*, std::string>> inherited;
    for (const char* name : {"DDP_DATA_CACHE_REPORTED", "DDP_DATA_CACHE_LOCK_REPORTED"}) {
      if (const char* value = std::getenv(name); value != nullptr) inherited.emplace_back(name, value);
    }
    ResetDecodedCacheWarningsForTesting();
    for (const auto& [name, value] : inherited) ::setenv(name, value.c_str(), 1);
    for (const auto& [name, value] : env) {
      if (value != nullptr) {
        ::setenv(name, value, 1);
      } else {
        ::unsetenv(name);
      }
    }
    ::_exit(body());
  }
  return ExitStatus(pid);
}

using EnvList = std::vector<std::pair<const char*, const char*>>;

// The variables of a process started outside any launcher: no local rank,
// and each of `reported` set empty, as a process makes it before main
// outside a launcher.
EnvList OutsideALauncher(std::initializer_list<const char*> reported) {
  EnvList env = {{"LOCAL_RANK", nullptr}, {"SLURM_LOCALID", nullptr}, {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}};
  for (const char* name : reported) env.emplace_back(name, "");
  return env;
}

// A trainer that starts its own ranks: a child started with `outside`
// (its stderr in `dir`/launcher_stderr) runs load("launcher"), then starts
// local ranks 0 and 1 (its children, inheriting what it set; their stderr
// in `dir`/self_launched_rank<r>_stderr), each running
// load("self_launched_rank<r>"). Returns 0, 1 when the launcher's load
// failed, or 10 + a rank's status.
int SelfLaunchedJob(const std::string& dir, const EnvList& outside,
                    const std::function<int(const std::string& who)>& load) {
  return InChildWithEnv(outside, dir + "/launcher_stderr", [&] {
    if (load("launcher") != 0) return 1;
    for (const char* rank : {"0", "1"}) {
      const std::string who = std::string("self_launched_rank") + rank;
      const int status = InChildWithEnv({{"LOCAL_RANK", rank}}, dir + "/" + who + "_stderr", [&] { return load(who); });
      if (status != 0) return 10 + status;
    }
    return 0;
  });
}

// After SelfLaunchedJob: the launcher gave the warning (`warnings` counts
// it in a stderr file) once, and its ranks not at all.
void ExpectSaidByTheLauncherAlone(const std::string& dir,
                                  const std::function<size_t(const std::string& file)>& warnings) {
  EXPECT_EQ(warnings(dir + "/launcher_stderr"), 1u) << ReadText(dir + "/launcher_stderr");
  for (const char* rank : {"0", "1"}) {
    const std::string file = dir + "/self_launched_rank" + rank + "_stderr";
    EXPECT_EQ(warnings(file), 0u) << "local rank " << rank << " of a launcher that said it: " << ReadText(file);
  }
}

// A cache folder that cannot be made is the same failure for every process
// of a job: a trainer that starts its own ranks said it from the launcher
// (which loads the sets to check them) and again from each rank. It is
// said once: by the launcher, whose ranks then stay quiet; under a
// launcher that loads nothing (ddprun, torchrun), by local rank 0 alone;
// and a rank whose launcher reported another folder still says it.
TEST(DecodedCache, AnUnwritableCacheIsReportedOncePerJob) {
  const std::string dir = FreshDir("decoded_once_per_job");
  WriteFile(dir + "/file", "a file, not a folder");
  const std::string cache_dir = dir + "/file/cache";
  const CacheDir cache(cache_dir);
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  const auto load = [&] {
    CountingDecode decode{src};
    return Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9) ? 0 : 1;
  };
  const std::string warning = "[ddp] warning: decoded dataset cache: cannot write " + cache_dir + "/images-";
  const auto warnings = [&](const std::string& file) { return Count(ReadText(file), warning); };
  const int launcher =
      SelfLaunchedJob(dir, OutsideALauncher({"DDP_DATA_CACHE_REPORTED"}), [&](const std::string&) { return load(); });
  ASSERT_EQ(launcher, 0) << "wrong bytes, or a child failed";
  ExpectSaidByTheLauncherAlone(dir, warnings);
  // Ranks of a launcher that loads nothing, told of another folder.
  const std::string other = dir + "/other";
  for (const char* rank : {"0", "1"}) {
    const std::string file = dir + "/rank" + rank + "_stderr";
    ASSERT_EQ(InChildWithEnv({{"LOCAL_RANK", rank}, {"DDP_DATA_CACHE_REPORTED", other.c_str()}}, file, load), 0);
    EXPECT_EQ(warnings(file), rank == std::string("0") ? 1u : 0u) << "local rank " << rank << ": " << ReadText(file);
  }
}

// A lock file that cannot be locked (NFS mounted without locks) is met
// alike by every process of a job that loads a set into a cold cache: a
// trainer that starts its own ranks said it from the launcher and again
// from each rank. It is said once, as an unwritable cache is: by the
// launcher, whose ranks then stay quiet; under a launcher that loads
// nothing, by local rank 0 alone, even when told that the cache could not
// be written (another kind of warning, which must not silence this one).
// Each process loads a set of its own, so that each meets a cold cache.
TEST(DecodedCache, ALockFileThatCannotBeLockedIsReportedOncePerJob) {
  const std::string dir = FreshDir("decoded_nolock_once_per_job");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  const auto load = [&](const std::string& who) {
    const std::string src = dir + "/" + who + "_images";
    WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
    CountingDecode decode{src};
    return Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9) ? 0 : 1;
  };
  const std::string probe = dir + "/probe";
  WriteFile(probe, "");
  const std::string warning = "[ddp] warning: decoded dataset cache: cannot lock " + cache_dir + "/";
  const auto warnings = [&](const std::string& file) { return Count(ReadText(file), warning); };
  const int status = InChildWithoutLocks(probe, [&] {
    return SelfLaunchedJob(dir, OutsideALauncher({"DDP_DATA_CACHE_REPORTED", "DDP_DATA_CACHE_LOCK_REPORTED"}), load);
  });
  ASSERT_NE(status, 2) << "the seccomp filter could not be installed";
  ASSERT_NE(status, 3) << "the seccomp filter did not make flock fail with ENOLCK";
  ASSERT_EQ(status, 0) << "wrong bytes, or a child failed";
  ExpectSaidByTheLauncherAlone(dir, warnings);
  // Ranks of a launcher that loads nothing, told that the cache folder
  // could not be written.
  for (const char* rank : {"0", "1"}) {
    const std::string file = dir + "/rank" + rank + "_stderr";
    const int status = InChildWithoutLocks(probe, [&] {
      return InChildWithEnv({{"LOCAL_RANK", rank}, {"DDP_DATA_CACHE_REPORTED", cache_dir.c_str()}}, file,
                            [&] { return load(std::string("rank") + rank); });
    });
    ASSERT_EQ(status, 0) << "local rank " << rank << ": wrong bytes, or no filter (2, 3)";
    EXPECT_EQ(warnings(file), rank == std::string("0") ? 1u : 0u) << "local rank " << rank << ": " << ReadText(file);
  }
}

// Where the filesystem has no locks, a lock file left by a process killed
// while it decoded (or by a host that mounts the folder with locks) could
// never be locked, so it was never removed. A load from an entry there
// removes one over an hour old, and leaves a fresh one (a load of another
// host may be decoding under it) and a non-empty file of that name.
TEST(DecodedCache, WithoutLocksALockFileOverAnHourOldIsRemovedByALoadFromAnEntry) {
  const std::string dir = FreshDir("decoded_nolock_stale");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  CountingDecode decode{dir + "/images"};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  const std::string stale = cache_dir + "/killed-0123456789abcdef.decoded.lock";
  WriteFile(stale, "");
  const struct timespec two_hours_ago[2] = {{::time(nullptr) - 7200, 0}, {::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, stale.c_str(), two_hours_ago, 0), 0) << std::strerror(errno);
  const std::string fresh = cache_dir + "/decoding-0123456789abcdef.decoded.lock";
  WriteFile(fresh, "");
  const std::string not_a_lock = cache_dir + "/notes.decoded.lock";
  WriteFile(not_a_lock, "kept by hand");
  ASSERT_EQ(::utimensat(AT_FDCWD, not_a_lock.c_str(), two_hours_ago, 0), 0) << std::strerror(errno);
  // Exit statuses: 1 for wrong bytes, 4 for a decode instead of the entry.
  const int status = InChildWithoutLocks(decode.path, [&] {
    CountingDecode again{decode.path};
    const bool right = Bytes(LoadDecoded(again.path, std::ref(again), 0)) == Want(80);
    return !right ? 1 : again.calls == 0 ? 0 : 4;
  });
  ASSERT_NE(status, 2) << "the seccomp filter could not be installed";
  ASSERT_NE(status, 3) << "the seccomp filter did not make flock fail with ENOLCK";
  EXPECT_EQ(status, 0) << "the load gave wrong bytes (1) or decoded instead of mapping the entry (4)";
  EXPECT_FALSE(std::filesystem::exists(stale)) << "a lock file two hours old was left where there are no locks";
  EXPECT_TRUE(std::filesystem::exists(fresh)) << "a fresh lock file was removed where there are no locks";
  EXPECT_TRUE(std::filesystem::exists(not_a_lock)) << "a file that is not a lock file was removed";
  EXPECT_TRUE(std::filesystem::exists(entry));
}

// Without locks, a load whose decode outlasts another process's load of the
// same set finds that one's entry in place when it is done: it maps it
// instead of writing a second copy over it (a whole write and fsync for
// nothing). The entry in place keeps its inode.
TEST(DecodedCache, WithoutLocksAnEntryWrittenDuringTheDecodeIsMappedNotReplaced) {
  const std::string dir = FreshDir("decoded_nolock_race");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  int started[2], go[2];
  ASSERT_EQ(::pipe(started), 0);
  ASSERT_EQ(::pipe(go), 0);
  // Exit statuses: 1 for wrong bytes, 5 when `go` did not come in 20 s.
  const pid_t slow = StartWithoutLocks(src, [&] {
    ::close(started[0]);
    ::close(go[1]);
    auto decode = [&] {
      if (::write(started[1], "d", 1) != 1) ::_exit(6);
      ::close(started[1]);
      pollfd p{go[0], POLLIN, 0};
      if (::poll(&p, 1, 20000) != 1) ::_exit(5);  // the parent closes its end when the other load is done
      IdxArray a = ReadIdxFile(src);
      return std::make_pair(a.dims, a.data);
    };
    return Bytes(LoadDecoded(src, decode, 0)) == Want(9) ? 0 : 1;
  });
  ASSERT_GT(slow, 0);
  ChildReaper slow_child(slow);  // an exception before the wait below kills and reaps it
  ::close(started[1]);
  ::close(go[0]);
  const bool decoding = ReadByteWithin(started[0], kHandshakeDeadline);
  ::close(started[0]);
  int fast = -1;
  if (decoding) {
    fast = InChildWithoutLocks(src, [&] {
      CountingDecode decode{src};
      return Bytes(LoadDecoded(src, std::ref(decode), 0)) == Want(9) && decode.calls == 1 ? 0 : 1;
    });
  }
  struct stat written{};
  const auto entries = Entries(cache_dir);
  const bool one_entry = entries.size() == 1 && ::stat(entries[0].c_str(), &written) == 0;
  ::close(go[1]);
  ASSERT_EQ(ExitStatus(slow_child.Release()), 0) << "the slow load failed";
  ASSERT_TRUE(decoding) << "the slow load did not start decoding";
  ASSERT_EQ(fast, 0) << "the other load did not decode and write the entry";
  ASSERT_TRUE(one_entry) << "no entry, or more files than one, after the other load";
  const auto after = Entries(cache_dir);
  ASSERT_EQ(after.size(), 1u);
  struct stat now{};
  ASSERT_EQ(::stat(after[0].c_str(), &now), 0);
  EXPECT_EQ(now.st_ino, written.st_ino) << "the slow load wrote its copy over the entry in place";
}

// Two loads of `src` (which decodes to `want`) without locks into the cache
// folder `dir`/cache: the slow one is paused once its temporary exists
// (after it chose how to put its entry in place) while the other loads the
// set whole and puts its entry in place. The slow one must then map that
// entry, leaving it in place (the same inode) with nothing beside it.
void ExpectAnEntryWrittenDuringTheWriteIsMappedNotReplaced(const std::string& dir, const std::string& src,
                                                           const std::vector<uint8_t>& want) {
  const std::string cache_dir = dir + "/cache";
  int started[2], go[2];
  ASSERT_EQ(::pipe(started), 0);
  ASSERT_EQ(::pipe(go), 0);
  // Exit statuses: 1 for wrong bytes, 5 when `go` did not come in 20 s.
  const pid_t slow = StartWithoutLocks(src, [&] {
    ::close(started[0]);
    ::close(go[1]);
    io::internal::SetTemporaryCreatedHookForTesting([&](const std::string&) {
      if (::write(started[1], "t", 1) != 1) ::_exit(6);
      ::close(started[1]);
      pollfd p{go[0], POLLIN, 0};
      if (::poll(&p, 1, 20000) != 1) ::_exit(5);  // the parent closes its end when the other load is done
    });
    CountingDecode decode{src};
    return Bytes(LoadDecoded(src, std::ref(decode), 0)) == want ? 0 : 1;
  });
  ASSERT_GT(slow, 0);
  ChildReaper slow_child(slow);  // an exception before the wait below kills and reaps it
  ::close(started[1]);
  ::close(go[0]);
  const bool writing = ReadByteWithin(started[0], kHandshakeDeadline);
  ::close(started[0]);
  int fast = -1;
  if (writing) {
    fast = InChildWithoutLocks(src, [&] {
      CountingDecode decode{src};
      return Bytes(LoadDecoded(src, std::ref(decode), 0)) == want && decode.calls == 1 ? 0 : 1;
    });
  }
  struct stat written{};
  std::string entry;
  for (const auto& e : Entries(cache_dir)) {
    if (e.string().find(".tmp.") == std::string::npos) entry = e.string();
  }
  const bool placed = !entry.empty() && ::stat(entry.c_str(), &written) == 0;
  ::close(go[1]);
  ASSERT_EQ(ExitStatus(slow_child.Release()), 0) << "the slow load failed";
  ASSERT_TRUE(writing) << "the slow load did not start writing";
  ASSERT_EQ(fast, 0) << "the other load did not decode and write the entry";
  ASSERT_TRUE(placed) << "no entry after the other load";
  const auto after = Entries(cache_dir);
  ASSERT_EQ(after.size(), 1u) << "a temporary was left beside the entry";
  struct stat now{};
  ASSERT_EQ(::stat(after[0].c_str(), &now), 0);
  EXPECT_EQ(now.st_ino, written.st_ino) << "the slow load put its copy over the entry in place";
}

// Without locks, the look for another process's entry after the decode
// came a whole write and fsync before the rename: an entry put in place in
// between was replaced (unlinked under the ranks that had it mapped, which
// on NFS lose it when another client unlinks it). The entry is now linked
// into place, which never replaces one: the load maps the entry in place.
// Here the other load writes while this one's temporary exists.
TEST(DecodedCache, WithoutLocksAnEntryWrittenDuringTheWriteIsMappedNotReplaced) {
  const std::string dir = FreshDir("decoded_nolock_write_race");
  const CacheDir cache(dir + "/cache");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  ExpectAnEntryWrittenDuringTheWriteIsMappedNotReplaced(dir, src, Want(9));
}

// The same race over a corrupt entry: both loads found a file at the name
// that was no valid entry, and each renamed its own over it, so the slow
// one replaced the other's whole entry (under ranks that may have mapped
// it). The corrupt file is now unlinked and the entry linked into place as
// into an empty name.
TEST(DecodedCache, WithoutLocksTwoLoadsOverACorruptEntryDoNotReplaceEachOthers) {
  const std::string dir = FreshDir("decoded_nolock_corrupt_race");
  const CacheDir cache(dir + "/cache");
  CountingDecode decode{dir + "/images"};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, decode);
  ASSERT_FALSE(entry.empty());
  FlipLastByte(entry);
  ExpectAnEntryWrittenDuringTheWriteIsMappedNotReplaced(dir, decode.path, Want(80));
  if (HasFatalFailure()) return;
  EXPECT_EQ(Bytes(LoadDecoded(decode.path, std::ref(decode), 0)), Want(80));
  EXPECT_EQ(decode.calls, 1) << "the entry left in place was not whole";
}

// Past DDP_DATA_CACHE_MAX_BYTES, writing an entry removes the least recently
// used others (the cache grew without bound): loading an entry counts as a
// use, the entry just written stays even alone over the limit, and files
// that are not whole entries (a temporary being written, a lock) are left.
// A process never evicts the entries it wrote or loaded itself (see
// EntriesThisProcessUsesStayPastTheLimit): forgetting them here stands for
// entries of earlier runs.
TEST(DecodedCache, EntriesPastTheSizeLimitAreEvictedLeastRecentlyUsedFirst) {
  const std::string dir = FreshDir("decoded_evict");
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir);
  std::vector<std::string> src;
  std::vector<CountingDecode> decode;
  for (const char* name : {"a_images", "b_images", "c_images"}) {
    src.push_back(dir + "/" + name);
    WriteFile(src.back(), IdxBytes({10, 100}, Pixels(1000)));
    decode.push_back(CountingDecode{src.back()});
  }
  auto entry_of = [&](size_t i) -> std::string {
    const std::string base = std::filesystem::path(src[i]).filename().string() + "-";
    for (const auto& e : Entries(cache_dir)) {
      const std::string name = e.filename().string();
      if (name.rfind(base, 0) == 0 && name.size() > 8 && name.substr(name.size() - 8) == ".decoded") return e.string();
    }
    return "";
  };
  auto set_age = [](const std::string& path, int seconds) {
    struct timespec times[2] = {{0, UTIME_OMIT}, {0, 0}};
    ::clock_gettime(CLOCK_REALTIME, &times[1]);
    times[1].tv_sec -= seconds;
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
  };
  // Each entry is ~1.1 KB: room for two.
  const ScopedEnv limit("DDP_DATA_CACHE_MAX_BYTES", "2500");
  LoadDecoded(src[0], std::ref(decode[0]), 0);
  LoadDecoded(src[1], std::ref(decode[1]), 0);
  ASSERT_NE(entry_of(0), "");
  ASSERT_NE(entry_of(1), "");
  ForgetDecodedEntriesInUseForTesting();
  set_age(entry_of(0), 200);
  set_age(entry_of(1), 100);
  // Not entries: never removed, however old.
  const std::string temporary = entry_of(0) + ".tmp.1.0-abc.host";
  const std::string lock = entry_of(1) + ".lock";
  WriteFile(temporary, std::string(5000, 't'));
  WriteFile(lock, "");
  set_age(temporary, 1000);
  set_age(lock, 1000);
  // A lock file is removed only when no one holds it
  // (LockFilesNoOneHoldsAreRemovedAtTheNextWrite); this one is held.
  const int lock_fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(lock_fd, 0);
  ASSERT_EQ(::flock(lock_fd, LOCK_EX | LOCK_NB), 0);
  LoadDecoded(src[0], std::ref(decode[0]), 0);  // a's entry used: now the newest
  EXPECT_EQ(decode[0].calls, 1);
  LoadDecoded(src[2], std::ref(decode[2]), 0);  // over the limit: b goes
  EXPECT_NE(entry_of(0), "");
  EXPECT_EQ(entry_of(1), "") << "the least recently used entry was kept";
  EXPECT_NE(entry_of(2), "");
  EXPECT_TRUE(std::filesystem::exists(temporary));
  EXPECT_TRUE(std::filesystem::exists(lock));
  ::close(lock_fd);
  LoadDecoded(src[0], std::ref(decode[0]), 0);
  EXPECT_EQ(decode[0].calls, 1) << "a recently used entry was removed";
  ForgetDecodedEntriesInUseForTesting();
  LoadDecoded(src[1], std::ref(decode[1]), 0);  // b decoded and written again: c, now the oldest, goes
  EXPECT_EQ(decode[1].calls, 2);
  EXPECT_NE(entry_of(0), "");
  EXPECT_NE(entry_of(1), "");
  EXPECT_EQ(entry_of(2), "");
  // A limit below one entry keeps the one just written.
  ForgetDecodedEntriesInUseForTesting();
  const ScopedEnv tiny("DDP_DATA_CACHE_MAX_BYTES", "0");
  LoadDecoded(src[2], std::ref(decode[2]), 0);
  EXPECT_EQ(decode[2].calls, 2);
  EXPECT_EQ(entry_of(0), "");
  EXPECT_EQ(entry_of(1), "");
  EXPECT_NE(entry_of(2), "");
}

// An entry another process has mapped (a job still training on it) is
// left by eviction, even past the limit: it was unlinked under that process
// (on NFS, by another host's eviction, which loses that process's pages).
// Once no process has it mapped, the next write removes it.
TEST(DecodedCache, AnEntryAnotherProcessHasMappedIsNotEvicted) {
  const std::string dir = FreshDir("decoded_mapped_elsewhere");
  const CacheDir cache(dir + "/cache");
  CountingDecode images{dir + "/images"};
  const std::filesystem::path entry = LoadIntoOneEntry(dir, images);  // written; not mapped here
  ASSERT_FALSE(entry.empty());
  ForgetDecodedEntriesInUseForTesting();
  int holding[2], done[2];
  ASSERT_EQ(::pipe(holding), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Exit statuses: 1 for wrong bytes, 4 for a decode instead of the
    // entry, 5 when `done` did not come in 20 s, 6 when `holding` could not
    // be written.
    ::close(holding[0]);
    ::close(done[1]);
    CountingDecode decode{images.path};
    const SharedArray mapped = LoadDecoded(decode.path, std::ref(decode), 0);
    if (decode.calls != 0) ::_exit(4);
    if (::write(holding[1], "m", 1) != 1) ::_exit(6);
    pollfd p{done[0], POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) ::_exit(5);  // the parent closes its end when it has written
    ::_exit(Bytes(mapped) == Want(80) ? 0 : 1);
  }
  ChildReaper child(pid);  // an exception before the wait below kills and reaps it
  ::close(holding[1]);
  ::close(done[0]);
  const bool held = ReadByteWithin(holding[0], kHandshakeDeadline);
  ::close(holding[0]);
  const ScopedEnv tiny("DDP_DATA_CACHE_MAX_BYTES", "0");  // each write evicts every entry it may
  CountingDecode labels{dir + "/labels"};
  WriteFile(labels.path, IdxBytes({4, 2}, Pixels(8)));
  if (held) {
    EXPECT_EQ(Bytes(LoadDecoded(labels.path, std::ref(labels), 0)), Want(8));
  }
  const bool kept = std::filesystem::exists(entry);
  ::close(done[1]);
  ASSERT_EQ(ExitStatus(child.Release()), 0)
      << "the child read wrong bytes (1), decoded (4), waited in vain (5) or could not say it held the entry (6)";
  ASSERT_TRUE(held) << "the child did not map the entry";
  EXPECT_TRUE(kept) << "the entry another process had mapped was evicted";
  ForgetDecodedEntriesInUseForTesting();
  CountingDecode more{dir + "/more"};
  WriteFile(more.path, IdxBytes({4, 3}, Pixels(12)));
  EXPECT_EQ(Bytes(LoadDecoded(more.path, std::ref(more), 0)), Want(12));
  EXPECT_FALSE(std::filesystem::exists(entry)) << "an entry no process has mapped any more stayed past the limit";
}

// A limit below what one run uses (its training and test sets together)
// kept only the entry last written: each load evicted the other set's
// entry, so every run decoded and wrote both again, and the cache cost more
// than none without a word. Entries this process wrote or loaded stay, and
// a warning names the limit and the bytes in use, once.
// EntriesThisProcessUsesStayPastTheLimit with DDP_DATA_CACHE set to the
// cache folder followed by `spelled_after` (a trailing slash or two).
void ExpectEntriesInUseStayPastTheLimit(const std::string& name, const std::string& spelled_after) {
  const std::string dir = FreshDir(name);
  const std::string cache_dir = dir + "/cache";
  const CacheDir cache(cache_dir + spelled_after);
  ForgetDecodedEntriesInUseForTesting();
  ResetDecodedCacheWarningsForTesting();
  std::vector<std::string> src;
  std::vector<CountingDecode> decode;
  for (const char* name : {"train_images", "test_images", "old_images"}) {
    src.push_back(dir + "/" + name);
    WriteFile(src.back(), IdxBytes({10, 100}, Pixels(1000)));
    decode.push_back(CountingDecode{src.back()});
  }
  // An entry of an earlier run, which may go.
  LoadDecoded(src[2], std::ref(decode[2]), 0);
  ForgetDecodedEntriesInUseForTesting();
  ASSERT_EQ(Entries(cache_dir).size(), 1u);
  // Each entry is ~1.1 KB: room for one.
  const ScopedEnv limit("DDP_DATA_CACHE_MAX_BYTES", "1500");
  StderrCapture capture;
  for (int run = 0; run < 2; ++run) {
    LoadDecoded(src[0], std::ref(decode[0]), 0);
    LoadDecoded(src[1], std::ref(decode[1]), 0);
  }
  const std::string warned = capture.Take();
  EXPECT_EQ(decode[0].calls, 1) << "the training set's entry was evicted by the test set's";
  EXPECT_EQ(decode[1].calls, 1);
  EXPECT_EQ(Entries(cache_dir).size(), 2u) << "the earlier run's entry was kept, or one of this one's went";
  EXPECT_NE(warned.find("DDP_DATA_CACHE_MAX_BYTES"), std::string::npos) << warned;
  EXPECT_NE(warned.find("may keep 1500 bytes"), std::string::npos) << warned;
  size_t count = 0;
  for (size_t at = warned.find("[ddp] warning"); at != std::string::npos; at = warned.find("[ddp] warning", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << warned;
}

TEST(DecodedCache, EntriesThisProcessUsesStayPastTheLimit) {
  ExpectEntriesInUseStayPastTheLimit("decoded_in_use", "");
}

// DDP_DATA_CACHE=/some/folder/ names the same folder: the entries this
// process used were recorded as "folder//entry" and never matched the
// folder's listing, so each load evicted the other's entry.
TEST(DecodedCache, ATrailingSlashInTheCacheFolderKeepsTheEntriesInUse) {
  ExpectEntriesInUseStayPastTheLimit("decoded_in_use_slash", "/");
  ExpectEntriesInUseStayPastTheLimit("decoded_in_use_slashes", "//");
  const CacheDir cache("/tmp/some/folder//");
  EXPECT_EQ(DecodedCacheDir(), "/tmp/some/folder");
  const CacheDir root("/");
  EXPECT_EQ(DecodedCacheDir(), "/");
}

// Every usual spelling of "off" turns the cache off; each was taken for a
// folder name, relative to the working directory, and cached into.
TEST(DecodedCache, OffInAnySpellingCachesNothing) {
  const std::string dir = FreshDir("decoded_off_spellings");
  const std::string src = dir + "/images";
  WriteFile(src, IdxBytes({3, 3}, Pixels(9)));
  const std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir);
  for (const char* off : {"0", "off", "OFF", "Off", "false", "False", "no", "NO", "none", "None"}) {
    const CacheDir cache(off);
    EXPECT_EQ(DecodedCacheDir(), "") << off;
    CountingDecode decode{src};
    EXPECT_EQ(Bytes(LoadDecoded(src, std::ref(decode), 0)), Want(9)) << off;
    LoadDecoded(src, std::ref(decode), 0);
    EXPECT_EQ(decode.calls, 2) << off;
    EXPECT_FALSE(std::filesystem::exists(dir + "/" + off)) << "cached into ./" << off;
  }
  std::filesystem::current_path(cwd);
  // A folder name that only contains one of them is a folder.
  const CacheDir cache(dir + "/offline");
  EXPECT_EQ(DecodedCacheDir(), dir + "/offline");
}

TEST(DecodedCache, SizeLimitComesFromTheEnvironment) {
  {
    const ScopedEnv unset("DDP_DATA_CACHE_MAX_BYTES", nullptr);
    EXPECT_EQ(DecodedCacheMaxBytes(), kDefaultCacheMaxBytes);
  }
  {
    const ScopedEnv set("DDP_DATA_CACHE_MAX_BYTES", "12345");
    EXPECT_EQ(DecodedCacheMaxBytes(), 12345u);
  }
  for (const char* bad : {"-1", "1e9", "lots", " 5"}) {
    const ScopedEnv set("DDP_DATA_CACHE_MAX_BYTES", bad);
    EXPECT_EQ(DecodedCacheMaxBytes(), kDefaultCacheMaxBytes) << bad;
  }
}

// Through the dataset loader: two loads of one set give the same samples,
// the second from the entry; a set of 1 MiB or more gets an entry, a smaller
// one none.
TEST(DecodedCache, DatasetLoadsShareTheEntry) {
  const std::string dir = FreshDir("decoded_dataset");
  const CacheDir cache(dir + "/cache");
  constexpr int64_t kImages = 1030;  // of 32 x 32: just over 1 MiB
  std::string labels(kImages, '\0');
  for (int64_t i = 0; i < kImages; ++i) labels[i] = static_cast<char>(i % 10);
  WriteFile(dir + "/train-images-idx3-ubyte.gz", Gzip(IdxBytes({kImages, 32, 32}, Pixels(kImages * 1024))));
  WriteFile(dir + "/train-labels-idx1-ubyte.gz", Gzip(IdxBytes({kImages}, labels)));
  WriteFile(dir + "/t10k-images-idx3-ubyte.gz", Gzip(IdxBytes({3, 2, 2}, Pixels(12))));
  WriteFile(dir + "/t10k-labels-idx1-ubyte.gz", Gzip(IdxBytes({3}, std::string("\0\1\2", 3))));
  const auto a = LoadMnist(dir, Split::kTrain);
  EXPECT_EQ(Entries(dir + "/cache").size(), 1u);
  const auto b = LoadMnist(dir, Split::kTrain);
  LoadMnist(dir, Split::kTest);
  EXPECT_EQ(Entries(dir + "/cache").size(), 1u) << "the small set was cached";
  ASSERT_EQ(b->Size(), kImages);
  for (int64_t i : {int64_t{0}, int64_t{517}, kImages - 1}) {
    EXPECT_EQ(std::vector<uint8_t>(a->Pixels(i), a->Pixels(i) + 1024),
              std::vector<uint8_t>(b->Pixels(i), b->Pixels(i) + 1024));
    EXPECT_EQ(b->Label(i), i % 10);
  }
  const std::vector<uint8_t> want = Want(kImages * 1024);
  EXPECT_EQ(std::vector<uint8_t>(b->Pixels(kImages - 1), b->Pixels(kImages - 1) + 1024),
            std::vector<uint8_t>(want.end() - 1024, want.end()));
}

// An entry may hold any int64 dimensions whose product is its data's size:
// no images of [2^40, 2^40, 2^40] pixels match 0 bytes. The loader checks
// the image shape before forming its pixel count, which overflowed (read
// as 0: "is empty").
TEST(DecodedCache, AnEntryWhoseImageShapeOverflowsIsNamedSo) {
  const std::string dir = FreshDir("decoded_overflow");
  const CacheDir cache(dir + "/cache");
  const std::string images = dir + "/images";
  const std::string labels = dir + "/labels";
  WriteFile(images, IdxBytes({1, 1024, 1024}, Pixels(size_t{1} << 20)));  // 1 MiB: cached
  WriteFile(labels, IdxBytes({1}, std::string(1, '\0')));
  LoadIdxDataset("forged", images, labels, 10);
  const auto entries = Entries(dir + "/cache");
  ASSERT_EQ(entries.size(), 1u);
  // The entry's header (magic, data bytes, ndims, nsources, CRC, reserved:
  // 32 bytes) and its source's stat (32 bytes) kept, then 4 dimensions and
  // no data, whose CRC-32 is 0.
  std::string entry;
  {
    std::ifstream in(entries[0], std::ios::binary);
    entry.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GE(entry.size(), 64u);
  std::string forged = entry.substr(0, 64);
  const uint64_t data_bytes = 0;
  const uint32_t ndims = 4, crc = 0;
  std::memcpy(forged.data() + 8, &data_bytes, 8);
  std::memcpy(forged.data() + 16, &ndims, 4);
  std::memcpy(forged.data() + 24, &crc, 4);
  for (const uint64_t dim : {uint64_t{0}, uint64_t{1} << 40, uint64_t{1} << 40, uint64_t{1} << 40}) {
    forged.append(reinterpret_cast<const char*>(&dim), 8);
  }
  WriteFile(entries[0].string(), forged);
  WriteFile(labels, IdxBytes({0}, ""));
  std::string msg;
  try {
    LoadIdxDataset("forged", images, labels, 10);
  } catch (const DatasetError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find(images + ": image shape [1099511627776, 1099511627776, 1099511627776] has more pixels "
                              "than int64 holds"),
            std::string::npos)
      << msg;
}

// The shared test helpers (test_files.h) that this file's tests lean on to
// end every child and every stderr capture, whatever way a test leaves.

// A child past its deadline is killed and reaped, the test fails once,
// naming it, and the status is -1, so that a caller adds nothing (it was the
// kill's status, and the caller's own check failed the test a second time,
// for a cause that was not the real one).
TEST(TestFiles, WaitChildKillsAChildPastItsDeadlineAndReturnsMinusOne) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << "fork: " << std::strerror(errno);
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  int status = 0;
  EXPECT_NONFATAL_FAILURE(status = WaitChild(pid, std::chrono::milliseconds(50)),
                          "was still running at its deadline; killed");
  EXPECT_EQ(status, -1);
  errno = 0;
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD) << "child " << pid << " was not reaped";
}

// A test that leaves (here by an exception) before waiting for its child
// leaves no child behind: the reaper kills and reaps it.
TEST(TestFiles, AChildReaperReapsTheChildOfATestThatLeftEarly) {
  pid_t pid = -1;
  try {
    pid = ::fork();
    ASSERT_GE(pid, 0) << "fork: " << std::strerror(errno);
    if (pid == 0) {
      ::pause();
      ::_exit(0);
    }
    ChildReaper child(pid);
    throw std::runtime_error("the test left early");
  } catch (const std::runtime_error&) {
  }
  errno = 0;
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD) << "child " << pid << " was not reaped";
}

// A capture that an exception left open is ended: gtest aborts the binary
// at a second capture while one is open.
TEST(TestFiles, AStderrCaptureThatAnExceptionLeftIsEnded) {
  try {
    StderrCapture capture;
    throw std::runtime_error("the test left early");
  } catch (const std::runtime_error&) {
  }
  StderrCapture again;
  std::fputs("after", stderr);
  EXPECT_EQ(again.Take(), "after");
}

}  // namespace
}  // namespace ddp::nn::data::internal
