#include "nn/data/idx.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <future>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "nn/data/file_bytes.h"
#include "nn/data/test_files.h"

namespace ddp::nn::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::ErrorWithinAddressSpace;
using testing::FreshDir;
using testing::Gzip;
using testing::IdxBytes;
using testing::WaitChild;
using testing::WriteFile;

// Runs `f`, expects a DatasetError and returns its message.
template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const DatasetError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no DatasetError thrown";
  return "";
}

TEST(FashionMnist, ReadsDebianTrainingSet) {
  auto train = LoadFashionMnist(kFashionMnistDebianDir, Split::kTrain);
  ASSERT_EQ(train->Size(), 60000);
  EXPECT_EQ(train->Shape(), (ImageShape{1, 28, 28}));
  EXPECT_EQ(train->NumClasses(), 10);
  // Values checked with Python's gzip module on the same files.
  const int64_t first_labels[] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(train->Label(i), first_labels[i]) << i;
  const uint8_t* first = train->Pixels(0);
  EXPECT_EQ(std::accumulate(first, first + 784, int64_t{0}), 76247);
  const uint8_t* last = train->Pixels(59999);
  EXPECT_EQ(std::accumulate(last, last + 784, int64_t{0}), 16684);
  std::vector<int> per_class(10);
  for (int64_t i = 0; i < train->Size(); ++i) ++per_class[train->Label(i)];
  for (int c = 0; c < 10; ++c) EXPECT_EQ(per_class[c], 6000) << c;
  // Kept as u8: one byte per pixel and per label.
  EXPECT_EQ(train->MemoryBytes(), 60000 * 785);
}

TEST(FashionMnist, ReadsDebianTestSet) {
  auto test = LoadFashionMnist(kFashionMnistDebianDir, Split::kTest);
  ASSERT_EQ(test->Size(), 10000);
  const int64_t first_labels[] = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(test->Label(i), first_labels[i]) << i;
  std::vector<uint8_t> buf(784);
  test->Get(3, buf.data());
  EXPECT_EQ(std::vector<uint8_t>(test->Pixels(3), test->Pixels(3) + 784), buf);
  EXPECT_THAT(test->Name(), HasSubstr("fashion_mnist/test"));
}

TEST(FashionMnist, MissingFilesNameThePackageAndDataDir) {
  const std::string dir = FreshDir("fm_missing");
  const std::string msg = ErrorOf([&] { LoadFashionMnist(dir, Split::kTrain); });
  EXPECT_THAT(msg, AllOf(HasSubstr(dir + "/train-images-idx3-ubyte.gz"),
                         HasSubstr("dataset-fashion-mnist"), HasSubstr("--data_dir")));
}

// A file given as the folder (the downloaded archive, say) is named as one:
// it was "dataset file not found: looked for FILE/train-images-...", with
// the advice to install the package.
TEST(FashionMnist, AFileGivenAsTheFolderIsNamedAsOne) {
  const std::string file = FreshDir("fm_file") + "/fashion-mnist.tar.gz";
  std::ofstream(file) << "an archive";
  EXPECT_EQ(ErrorOf([&] { LoadFashionMnist(file, Split::kTrain); }),
            "dataset folder " + file + " is a file: train-images-idx3-ubyte (or train-images-idx3-ubyte.gz) is "
            "looked for inside a folder; give the folder that holds it");
}

TEST(Mnist, MissingFilesNameDataDir) {
  const std::string dir = FreshDir("mnist_missing");
  const std::string msg = ErrorOf([&] { LoadMnist(dir, Split::kTest); });
  EXPECT_THAT(msg, AllOf(HasSubstr(dir + "/t10k-images-idx3-ubyte"), HasSubstr("--data_dir")));
}

// A folder or a broken link by a file's name is said to be one ("not
// found" alone named a path that is there): Kaggle's MNIST unpacks into
// folders named as the files.
TEST(Mnist, AFolderByTheFilesNameIsNamedAsOne) {
  const std::string dir = FreshDir("mnist_folders");
  ASSERT_EQ(::mkdir((dir + "/train-images-idx3-ubyte").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("nowhere", (dir + "/train-images-idx3-ubyte.gz").c_str()), 0);
  EXPECT_THAT(ErrorOf([&] { LoadMnist(dir, Split::kTrain); }),
              AllOf(HasSubstr("(" + dir + "/train-images-idx3-ubyte.gz is a symbolic link to nothing)"),
                    HasSubstr("(" + dir + "/train-images-idx3-ubyte is a folder)"), HasSubstr("--data_dir")));
  const std::string plain = FreshDir("mnist_plain_missing");
  EXPECT_THAT(ErrorOf([&] { LoadMnist(plain, Split::kTrain); }), Not(HasSubstr(" is a")));
}

// A tiny MNIST-format dataset: 3 images of 2x2, labels 0..2.
struct TinySet {
  std::string images = IdxBytes({3, 2, 2}, std::string("\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c", 12));
  std::string labels = IdxBytes({3}, std::string("\x00\x01\x02", 3));
};

TEST(Mnist, ReadsPlainAndGzipFilesAlike) {
  TinySet t;
  const std::string plain = FreshDir("mnist_plain");
  WriteFile(plain + "/train-images-idx3-ubyte", t.images);
  WriteFile(plain + "/train-labels-idx1-ubyte", t.labels);
  const std::string gz = FreshDir("mnist_gz");
  WriteFile(gz + "/train-images-idx3-ubyte.gz", Gzip(t.images));
  WriteFile(gz + "/train-labels-idx1-ubyte.gz", Gzip(t.labels));
  for (const std::string& dir : {plain, gz}) {
    auto ds = LoadMnist(dir, Split::kTrain);
    ASSERT_EQ(ds->Size(), 3);
    EXPECT_EQ(ds->Shape(), (ImageShape{1, 2, 2}));
    EXPECT_EQ(ds->Label(2), 2);
    EXPECT_EQ(ds->Pixels(1)[0], 5);
    EXPECT_EQ(ds->Pixels(2)[3], 12);
  }
}

TEST(Idx, ConcatenatedGzipMembersAreOneStream) {
  TinySet t;
  const std::string dir = FreshDir("idx_members");
  WriteFile(dir + "/a.gz", Gzip(t.images.substr(0, 7)) + Gzip(t.images.substr(7)));
  IdxArray a = ReadIdxFile(dir + "/a.gz", 3);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(a.data.size(), 12u);
}

// Zeros after the last member (a file padded to a block size) end the data,
// as gzip(1) and Python's gzip take them (the reader called them a corrupt
// header); other bytes there are named as what they are.
TEST(Idx, ZeroPaddingAfterTheGzipDataIsIgnored) {
  TinySet t;
  const std::string dir = FreshDir("idx_gz_padding");
  const std::string gz = Gzip(t.images.substr(0, 7)) + Gzip(t.images.substr(7));
  WriteFile(dir + "/a.gz", gz + std::string(512, '\0'));
  IdxArray a = ReadIdxFile(dir + "/a.gz", 3);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(std::string(a.data.begin(), a.data.end()), t.images.substr(16));
  WriteFile(dir + "/b.gz", gz + std::string(3, '\0') + "junk");
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/b.gz"); }),
              AllOf(HasSubstr(dir + "/b.gz: 7 bytes after the gzip data, which ends at compressed byte " +
                              std::to_string(gz.size())),
                    HasSubstr("neither another gzip member nor zero padding")));
}

// Zeros between members (members padded to a block size, then
// concatenated) are skipped and the next member read, as Python's gzip does
// (the reader refused them); positions in later errors count the zeros.
TEST(Idx, ZeroPaddingBetweenGzipMembersIsSkipped) {
  TinySet t;
  const std::string dir = FreshDir("idx_gz_inner_padding");
  const std::string first = Gzip(t.images.substr(0, 7)) + std::string(100, '\0');
  const std::string second = Gzip(t.images.substr(7));
  WriteFile(dir + "/a.gz", first + second + std::string(20, '\0'));
  IdxArray a = ReadIdxFile(dir + "/a.gz", 3);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(std::string(a.data.begin(), a.data.end()), t.images.substr(16));
  WriteFile(dir + "/b.gz", first + second.substr(0, second.size() - 6));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/b.gz"); }),
              HasSubstr(dir + "/b.gz: gzip data is truncated after " +
                        std::to_string(first.size() + second.size() - 6) + " compressed bytes"));
}

TEST(Idx, FourDimensionalImagesKeepChannels) {
  const std::string dir = FreshDir("idx_4d");
  WriteFile(dir + "/im", IdxBytes({2, 3, 1, 1}, "abcdef"));
  WriteFile(dir + "/lb", IdxBytes({2}, std::string("\x01\x00", 2)));
  auto ds = LoadIdxDataset("four", dir + "/im", dir + "/lb", 2);
  EXPECT_EQ(ds->Shape(), (ImageShape{3, 1, 1}));
  EXPECT_EQ(ds->Pixels(1)[2], 'f');
}

TEST(IdxErrors, ShorterThanMagic) {
  EXPECT_THAT(ErrorOf([] { ParseIdx("\0\0", "f.idx"); }),
              AllOf(HasSubstr("f.idx"), HasSubstr("shorter than the 4-byte magic")));
}

TEST(IdxErrors, BadMagic) {
  EXPECT_THAT(ErrorOf([] { ParseIdx(std::string("\x12\x34\x08\x01\0\0\0\0", 8), "f.idx"); }),
              AllOf(HasSubstr("f.idx"), HasSubstr("0x12 0x34"), HasSubstr("expected 0x00 0x00")));
}

TEST(IdxErrors, UnsupportedDataType) {
  EXPECT_THAT(ErrorOf([] { ParseIdx(IdxBytes({1}, "abcd", 0x0D), "f.idx"); }),
              AllOf(HasSubstr("0x0D"), HasSubstr("float32"), HasSubstr("expected 0x08")));
}

TEST(IdxErrors, ZeroDimensions) {
  EXPECT_THAT(ErrorOf([] { ParseIdx(IdxBytes({}, ""), "f.idx"); }),
              HasSubstr("0 dimensions, expected 1 to 8"));
}

TEST(IdxErrors, WrongDimensionCount) {
  EXPECT_THAT(ErrorOf([] { ParseIdx(IdxBytes({2, 2}, "abcd"), "f.idx", 3); }),
              AllOf(HasSubstr("f.idx"), HasSubstr("2 dimensions, expected 3")));
}

TEST(IdxErrors, TruncatedHeader) {
  std::string b = IdxBytes({3, 2, 2}, "");
  EXPECT_THAT(ErrorOf([&] { ParseIdx(b.substr(0, 9), "f.idx"); }),
              HasSubstr("f.idx: IDX header truncated: 3 dimensions need 16 bytes, the data has 9"));
  const std::string dir = FreshDir("idx_short_header");
  WriteFile(dir + "/f.idx", b.substr(0, 9));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/f.idx"); }),
              HasSubstr("/f.idx: IDX header truncated: 3 dimensions need 16 bytes, the file has 9"));
}

TEST(IdxErrors, TruncatedData) {
  EXPECT_THAT(ErrorOf([] { ParseIdx(IdxBytes({3, 2, 2}, "abcdefghijk"), "f.idx"); }),
              AllOf(HasSubstr("f.idx"), HasSubstr("data truncated"), HasSubstr("[3, 2, 2]"),
                    HasSubstr("need 12 bytes"), HasSubstr("found 11")));
}

TEST(IdxErrors, HugeDimensionsAreTruncationNotAllocation) {
  EXPECT_THAT(ErrorOf([] {
                ParseIdx(IdxBytes({0xffffffffu, 0xffffffffu, 0xffffffffu}, "ab"), "f.idx");
              }),
              AllOf(HasSubstr("data truncated"), HasSubstr("more than 2^62")));
}

long PeakResidentKb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// A header asking for more than the bytes there are fails before the data
// is copied: 128 MiB of input under a header that wants 4 GiB costs no
// 128 MiB copy.
TEST(IdxErrors, HeaderAskingForMoreThanTheInputFailsBeforeCopying) {
  const std::string bytes = IdxBytes({0xffffffffu}, std::string(size_t{128} << 20, 'x'));
  std::ofstream("/proc/self/clear_refs") << "5";  // restart the peak count
  const long before = PeakResidentKb();
  ASSERT_GT(before, 0);
  EXPECT_THAT(ErrorOf([&] { ParseIdx(bytes, "f.idx"); }),
              AllOf(HasSubstr("data truncated"), HasSubstr("need 4294967295 bytes"),
                    HasSubstr("found 134217728")));
  EXPECT_LT(PeakResidentKb() - before, 16 << 10);
}

// A file of gigabytes that is no IDX file fails at its magic number, read in
// a few bytes: the whole file was read into memory first. The file is
// sparse (8 GiB that take no disk) and read where 256 MiB more address
// space is all there is, so that a whole read fails to allocate.
TEST(IdxErrors, AHugeFileWithABadMagicFailsWithoutBeingRead) {
  const std::string dir = FreshDir("idx_huge_magic");
  const std::string path = dir + "/train-images-idx3-ubyte";
  WriteFile(path, std::string("\x12\x34\x08\x03", 4));
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { ReadIdxFile(path); }),
              HasSubstr(path + ": not an IDX file: magic number starts with 0x12 0x34"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// A valid header on gigabytes of other bytes fails on the file's size,
// before the data is read, naming the size the header gives and the
// file's; so does a file a few bytes too long.
TEST(IdxErrors, AValidHeaderOnGigabytesOfOtherBytesFailsBeforeReadingThem) {
  const std::string dir = FreshDir("idx_huge_tail");
  const std::string path = dir + "/images";
  WriteFile(path, IdxBytes({3, 2, 2}, std::string(12, 'x')));
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { ReadIdxFile(path); }),
              HasSubstr(path + ": 8589934564 unexpected bytes after the IDX data: dimensions [3, 2, 2] need 12 "
                               "bytes after the 16-byte header, 28 in all, but the file has 8589934592 bytes"));
  WriteFile(path, IdxBytes({3, 2, 2}, std::string(15, 'x')));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(path); }),
              HasSubstr(path + ": 3 unexpected bytes after the IDX data: dimensions [3, 2, 2] need 12 bytes "
                               "after the 16-byte header, 28 in all, but the file has 31 bytes"));
  // A file short of the data is still truncated, and one of the right size reads.
  WriteFile(path, IdxBytes({3, 2, 2}, std::string(11, 'x')));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(path); }),
              HasSubstr(path + ": IDX data truncated: dimensions [3, 2, 2] need 12 bytes after the 16-byte "
                               "header, found 11"));
  WriteFile(path, IdxBytes({3, 2, 2}, std::string(12, 'y')));
  EXPECT_EQ(ReadIdxFile(path).data, std::vector<uint8_t>(12, 'y'));
}

// A gzip stream whose data goes on past what its header declares stops at
// the first byte too many: the rest was decompressed (up to the bound, by
// default 4 GiB) only to be counted. Here 2 MiB of zeros follow the data,
// under a bound of 1 MiB that a read to the end reaches.
TEST(IdxErrors, GzipDataPastTheHeadersSizeStopsAtTheFirstByteTooMany) {
  const std::string gz = Gzip(IdxBytes({3}, "abc" + std::string(size_t{2} << 20, '\0')));
  EXPECT_THAT(ErrorOf([&] { ParseIdxFileBytes(gz, "tail.gz", 0, size_t{1} << 20); }),
              HasSubstr("tail.gz: unexpected bytes after the IDX data: dimensions [3] need 3 bytes after the "
                        "8-byte header, and the data goes on past them"));
}

// A byte flipped in a real gzip file can make its stream give more bytes
// than the IDX header says, before the stream's CRC (at its end) is
// reached: the error says that the cause may be a corrupt stream, not only
// data after the IDX data. The first such flip of Fashion-MNIST's test
// labels is looked for (one in about eleven does it).
TEST(IdxErrors, ACorruptGzipStreamThatRunsLongIsNotCalledTrailingDataAlone) {
  std::ifstream in(std::string(kFashionMnistDebianDir) + "/t10k-labels-idx1-ubyte.gz", std::ios::binary);
  const std::string real((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(real.size(), 1000u);
  std::string found;
  for (size_t i = real.size() / 2; i < real.size() && found.empty(); ++i) {
    std::string bytes = real;
    bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
    try {
      ParseIdxFileBytes(bytes, "labels.gz", 1);
    } catch (const DatasetError& e) {
      if (std::string(e.what()).find("the data goes on past them") != std::string::npos) found = e.what();
    }
  }
  ASSERT_FALSE(found.empty()) << "no flip made the stream run long";
  EXPECT_THAT(found, HasSubstr("labels.gz: unexpected bytes after the IDX data: dimensions [10000] need 10000 bytes "
                               "after the 8-byte header, and the data goes on past them (or the gzip data is "
                               "corrupt: its checksum, at the end of the stream, was not reached)"));
}

TEST(IdxErrors, NoItemsOfOverflowingSizeAreAnError) {
  // Zero items would make the total 0 bytes, but each item's size overflows.
  EXPECT_THAT(ErrorOf([] {
                ParseIdx(IdxBytes({0, 0xffffffffu, 0xffffffffu, 0xffffffffu}, ""), "f.idx");
              }),
              AllOf(HasSubstr("f.idx"), HasSubstr("more than 2^62")));
}

// Bytes in memory are called data, not a file (there is none).
TEST(IdxErrors, TrailingBytes) {
  const std::string error = ErrorOf([] { ParseIdx(IdxBytes({2}, "abc"), "f.idx"); });
  EXPECT_THAT(error, HasSubstr("f.idx: 1 unexpected bytes after the IDX data: dimensions [2] need 2 bytes after the "
                               "8-byte header, 10 in all, but the data has 11 bytes"));
  EXPECT_THAT(error, Not(HasSubstr("file")));
}

TEST(IdxErrors, CorruptGzip) {
  TinySet t;
  std::string gz = Gzip(t.images);
  gz[gz.size() / 2] ^= 0x5a;
  gz[gz.size() / 2 + 1] ^= 0x33;
  const std::string dir = FreshDir("idx_corrupt_gz");
  WriteFile(dir + "/x.gz", gz);
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/x.gz"); }),
              AllOf(HasSubstr(dir + "/x.gz"), HasSubstr("gzip")));
}

TEST(IdxErrors, TruncatedGzip) {
  TinySet t;
  std::string gz = Gzip(t.images);
  const std::string dir = FreshDir("idx_trunc_gz");
  WriteFile(dir + "/x.gz", gz.substr(0, gz.size() - 6));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/x.gz"); }),
              AllOf(HasSubstr(dir + "/x.gz"), HasSubstr("truncated")));
}

TEST(IdxErrors, TruncatedSecondGzipMemberCountsTheFirstMembersBytes) {
  TinySet t;
  const std::string first = Gzip(t.images.substr(0, 7));
  const std::string second = Gzip(t.images.substr(7));
  const std::string dir = FreshDir("idx_trunc_member");
  WriteFile(dir + "/x.gz", first + second.substr(0, second.size() - 6));
  // The second member stops 6 bytes short: the message counts from the
  // file's start, not the member's.
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/x.gz"); }),
              HasSubstr("truncated after " + std::to_string(first.size() + second.size() - 6) +
                        " compressed bytes"));
}

TEST(IdxErrors, DecompressedSizeIsBounded) {
  const std::string big = IdxBytes({1 << 20}, std::string(1 << 20, 'x'));
  EXPECT_EQ(ParseIdxFileBytes(Gzip(big), "big.gz").data.size(), 1u << 20);
  EXPECT_THAT(ErrorOf([&] { ParseIdxFileBytes(Gzip(big), "big.gz", 0, 4096); }),
              AllOf(HasSubstr("big.gz"), HasSubstr("more than 4096 bytes")));
}

// A gzip stream whose header asks for more than the bound fails at the
// header, naming the dimensions, instead of after decompressing up to the
// bound (here 16 MiB of zeros behind a header wanting 4 GiB).
TEST(IdxErrors, GzipHeaderOverTheBoundFailsBeforeDecompressing) {
  const std::string gz = Gzip(IdxBytes({0xffffffffu}, std::string(size_t{16} << 20, '\0')));
  EXPECT_THAT(ErrorOf([&] { ParseIdxFileBytes(gz, "big.gz"); }),
              AllOf(HasSubstr("big.gz"), HasSubstr("dimensions [4294967295] need 4294967303 bytes"),
                    HasSubstr("more than 4294967296 bytes (the bound on decompressed data)")));
  const std::string overflowing = Gzip(IdxBytes({0xffffffffu, 0xffffffffu, 0xffffffffu}, "ab"));
  EXPECT_THAT(ErrorOf([&] { ParseIdxFileBytes(overflowing, "o.gz"); }),
              AllOf(HasSubstr("[4294967295, 4294967295, 4294967295] need more than 2^62 bytes"),
                    HasSubstr("the bound on decompressed data")));
  // A header within the bound still reads.
  EXPECT_EQ(ParseIdxFileBytes(Gzip(IdxBytes({3}, "abc")), "ok.gz", 0, 11).data.size(), 3u);
}

// The trailer's size field only sizes the first allocation: one that
// claims 4 GiB for a few hundred compressed bytes neither allocates that
// (capped by deflate's largest ratio) nor goes unnoticed (zlib checks it).
TEST(IdxErrors, ForgedGzipSizeFieldIsCorruptNotAnAllocation) {
  TinySet t;
  std::string gz = Gzip(t.images);
  for (size_t i = gz.size() - 4; i < gz.size(); ++i) gz[i] = static_cast<char>(0xff);
  EXPECT_THAT(ErrorOf([&] { ParseIdxFileBytes(gz, "forged.gz"); }),
              AllOf(HasSubstr("forged.gz"), HasSubstr("corrupt gzip data")));
  // The right size decompresses as before.
  EXPECT_EQ(ParseIdxFileBytes(Gzip(t.images), "ok.gz").data.size(), t.images.size() - 16);
}

TEST(IdxErrors, UnreadableFileNamesTheOsError) {
  const std::string dir = FreshDir("idx_dir");
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir + "/nope"); }),
              AllOf(HasSubstr(dir + "/nope"), HasSubstr("No such file")));
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(dir); }), HasSubstr("not a regular file"));
}

// A FIFO where a dataset file should be is refused at once, naming it: the
// open waited for a writer, and the load hung without a word.
TEST(IdxErrors, FifoIsRefusedWithoutWaitingForAWriter) {
  const std::string dir = FreshDir("idx_fifo");
  const std::string fifo = dir + "/train-images-idx3-ubyte";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  for (const auto& [what, read] :
       {std::pair<const char*, std::function<void()>>{"ReadIdxFile", [&] { ReadIdxFile(fifo); }},
        {"ReadMaybeGzipFile", [&] { internal::ReadMaybeGzipFile(fifo); }}}) {
    auto error = std::async(std::launch::async, [&read] { return ErrorOf(read); });
    if (error.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      // Let the waiting open return (a writer appears), so that the test ends.
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
      ADD_FAILURE() << what << " still waits on the FIFO after 10 s";
    }
    EXPECT_THAT(error.get(), AllOf(HasSubstr(fifo), HasSubstr("not a regular file"))) << what;
  }
}

// --------------------------------------------------- streaming readers ----

// Read in pieces of any size, the stream gives the same bytes as Gunzip,
// across member boundaries too; exactly max_bytes of output is allowed and
// one byte more is not.
TEST(GzipReaderTest, PiecesEqualTheWholeAndTheBoundIsExact) {
  std::string data(300000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  const std::string two = Gzip(data.substr(0, 123457)) + Gzip(data.substr(123457));
  ASSERT_EQ(internal::Gunzip(two, "two.gz"), data);
  for (size_t piece : {1, 7, 4096, 65536, 1 << 20}) {
    internal::GzipReader reader(two, "two.gz");
    std::string got;
    std::string buf(piece, '\0');
    for (size_t n; (n = reader.Read(buf.data(), piece)) > 0;) got.append(buf, 0, n);
    EXPECT_EQ(got, data) << "pieces of " << piece;
    EXPECT_EQ(reader.Read(buf.data(), piece), 0u) << "the end stays the end";
  }
  EXPECT_EQ(internal::Gunzip(two, "two.gz", data.size()), data);
  EXPECT_THAT(ErrorOf([&] { internal::Gunzip(two, "two.gz", data.size() - 1); }),
              HasSubstr("decompresses to more than " + std::to_string(data.size() - 1) + " bytes"));
  // The hint is the last member's size field.
  EXPECT_EQ(internal::GzipReader(two, "two.gz").SizeHint(), data.size() - 123457);
}

// An IDX file whose gzip members cut through its header and its data reads
// as the plain file does.
TEST(GzipReaderTest, IdxAcrossMembersParsesAsPlain) {
  TinySet t;
  const std::string gz = Gzip(t.images.substr(0, 6)) + Gzip(t.images.substr(6, 14)) + Gzip(t.images.substr(20));
  const IdxArray a = ParseIdxFileBytes(gz, "members.gz"), b = ParseIdx(t.images, "plain");
  EXPECT_EQ(a.dims, b.dims);
  EXPECT_EQ(a.data, b.data);
}

// All the output of `reader`.
std::string Drain(internal::GzipReader& reader) {
  std::string got, buf(5000, '\0');
  for (size_t n; (n = reader.Read(buf.data(), buf.size())) > 0;) got.append(buf, 0, n);
  return got;
}

// Over a file read a few bytes at a time, the reader gives what it gives
// over the same bytes in memory: across members, and zeros between and
// after them that span reads; and the same errors, for bytes after the
// data that are no member (one byte of them, or more) and for a file cut
// short.
TEST(GzipReaderTest, OverAFileInSmallReadsEqualsInMemory) {
  std::string data(100000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  const std::string gz =
      Gzip(data.substr(0, 40000)) + std::string(5, '\0') + Gzip(data.substr(40000)) + std::string(7, '\0');
  const std::string dir = FreshDir("gzip_file");
  const std::string path = dir + "/a.gz";
  WriteFile(path, gz);
  const std::vector<size_t> chunks = {1, 2, 3, 7, 4096, internal::kGzipInputChunk};
  {
    const internal::OpenFile file(path);
    for (size_t chunk : chunks) {
      internal::GzipReader reader(file, "a.gz", internal::kMaxDecompressedBytes, chunk);
      EXPECT_EQ(Drain(reader), data) << "reads of " << chunk;
    }
  }
  for (const std::string& bad : {gz + "x", gz + "junk", gz + "\x1f", gz.substr(0, gz.size() / 2)}) {
    WriteFile(path, bad);
    const std::string want = ErrorOf([&] { internal::Gunzip(bad, "b.gz"); });
    ASSERT_THAT(want, HasSubstr("b.gz: "));
    const internal::OpenFile file(path);
    for (size_t chunk : chunks) {
      EXPECT_EQ(ErrorOf([&] {
                  internal::GzipReader reader(file, "b.gz", internal::kMaxDecompressedBytes, chunk);
                  Drain(reader);
                }),
                want)
          << "reads of " << chunk;
    }
  }
}

// A gzip file of gigabytes fails where its stream goes wrong, having read
// only that far: it was read whole into memory first. The files are sparse
// (8 GiB that take no disk), read where 256 MiB more address space is all
// there is: a stream whose IDX header is wrong, and a right one followed by
// other bytes than gzip data.
TEST(IdxErrors, AHugeGzipFileFailsWhereItsStreamGoesWrong) {
  const std::string dir = FreshDir("idx_huge_gz");
  const std::string path = dir + "/train-images-idx3-ubyte.gz";
  WriteFile(path, Gzip(std::string("\x12\x34\x08\x03", 4) + std::string(100, 'x')));
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { ReadIdxFile(path); }),
              HasSubstr(path + ": not an IDX file: magic number starts with 0x12 0x34"));
  const std::string gz = Gzip(IdxBytes({3}, "abc"));
  WriteFile(path, gz + "junk");
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { ReadIdxFile(path); }),
              HasSubstr(path + ": " + std::to_string((uint64_t{8} << 30) - gz.size()) +
                        " bytes after the gzip data, which ends at compressed byte " + std::to_string(gz.size())));
}

// Bytes this process has read from files so far, as the kernel counts
// them (rchar in /proc/self/io).
uint64_t BytesReadSoFar() {
  std::ifstream io("/proc/self/io");
  for (std::string line; std::getline(io, line);) {
    if (line.rfind("rchar:", 0) == 0) return std::stoull(line.substr(6));
  }
  ADD_FAILURE() << "no rchar line in /proc/self/io";
  return 0;
}

// Zeros after a gzip member are padding (gzip(1) takes them too), and a
// file extended by truncate has gigabytes of them as a hole: the hole is
// skipped, not read (all 4 GiB were read and scanned, seconds spent to
// find the end). A member or other bytes after the hole are still found,
// and positions count the hole.
TEST(GzipReaderTest, AHoleOfZerosAfterAMemberIsSkippedUnread) {
  const std::string dir = FreshDir("gzip_hole");
  const std::string path = dir + "/train-labels-idx1-ubyte.gz";
  const std::string idx = IdxBytes({3}, "abc");
  const std::string gz = Gzip(idx);
  const uint64_t hole = uint64_t{4} << 30;
  const auto write_with_hole = [&](const std::string& after) {
    WriteFile(path, gz);
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(gz.size() + hole)), 0) << path << ": " << std::strerror(errno);
    FILE* f = std::fopen(path.c_str(), "ab");
    ASSERT_NE(f, nullptr) << path;
    ASSERT_EQ(std::fwrite(after.data(), 1, after.size(), f), after.size()) << path;
    ASSERT_EQ(std::fclose(f), 0) << path;
  };
  write_with_hole("");
  uint64_t before = BytesReadSoFar();
  const IdxArray a = ReadIdxFile(path, 1);
  EXPECT_EQ(std::string(a.data.begin(), a.data.end()), "abc");
  EXPECT_LT(BytesReadSoFar() - before, uint64_t{64} << 20) << "bytes read, of a 4 GiB hole";

  write_with_hole(Gzip("defg"));
  before = BytesReadSoFar();
  {
    const internal::OpenFile file(path);
    internal::GzipReader reader(file, "hole.gz");
    EXPECT_EQ(Drain(reader), idx + "defg");
  }
  EXPECT_LT(BytesReadSoFar() - before, uint64_t{64} << 20) << "bytes read, of a 4 GiB hole";

  write_with_hole("junk");
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(path); }),
              HasSubstr(path + ": " + std::to_string(hole + 4) +
                        " bytes after the gzip data, which ends at compressed byte " + std::to_string(gz.size()) +
                        ", are neither another gzip member nor zero padding"));
}

// Written zeros after a member are padding only up to a bound: a tail of
// gigabytes of them was read and scanned to the end (as long as reading a
// real file that size, and forever for one that grows with zeros while
// read). Past kMaxGzipZeroPaddingRead the read stops with an error naming
// the file and where its gzip data ends; less is still padding.
TEST(GzipReaderTest, WrittenZerosAfterAMemberAreReadOnlyUpToTheBound) {
  const std::string dir = FreshDir("gzip_zero_tail");
  const std::string path = dir + "/train-labels-idx1-ubyte.gz";
  const std::string idx = IdxBytes({3}, "abc");
  const std::string gz = Gzip(idx);
  WriteFile(path, gz + std::string(size_t{1} << 20, '\0'));
  const IdxArray a = ReadIdxFile(path, 1);
  EXPECT_EQ(std::string(a.data.begin(), a.data.end()), "abc");

  WriteFile(path, gz + std::string(internal::kMaxGzipZeroPaddingRead + (uint64_t{4} << 20), '\0') + Gzip("defg"));
  const uint64_t before = BytesReadSoFar();
  EXPECT_THAT(ErrorOf([&] { ReadIdxFile(path); }),
              HasSubstr(path + ": more than " + std::to_string(internal::kMaxGzipZeroPaddingRead) +
                        " bytes of zeros after the gzip data, which ends at compressed byte " +
                        std::to_string(gz.size())));
  EXPECT_LT(BytesReadSoFar() - before, internal::kMaxGzipZeroPaddingRead + (uint64_t{2} << 20))
      << "bytes read of a file whose zeros pass the bound";
  const std::string bytes = gz + std::string(internal::kMaxGzipZeroPaddingRead + 1, '\0');
  EXPECT_THAT(ErrorOf([&] { internal::Gunzip(bytes, "in memory"); }),
              HasSubstr("in memory: more than " + std::to_string(internal::kMaxGzipZeroPaddingRead) +
                        " bytes of zeros after the gzip data"));
}

// A gzip file of `n` bytes of noise (which deflate cannot shrink) under
// `header`, whose trailer's size field is forged to 4 GiB - 1.
std::string GzipWithForgedSize(const std::string& header, size_t n) {
  std::mt19937 gen(7);
  std::string body(n, '\0');
  for (char& c : body) c = static_cast<char>(gen());
  std::string gz = Gzip(header + body);
  for (size_t i = gz.size() - 4; i < gz.size(); ++i) gz[i] = '\xff';
  return gz;
}

// A gzip trailer's size is forgeable, and so is an IDX header's: together
// they asked for a reservation of nearly 4 GiB, which where the memory is
// not there (here 256 MiB more address space) failed with a bare
// std::bad_alloc naming no file. The data now grows as it comes, and the
// load fails on what is wrong with the file, naming it.
TEST(IdxErrors, AForgedGzipSizeMakesNoHugeReservation) {
  const std::string dir = FreshDir("idx_forged_isize");
  const std::string path = dir + "/train-images-idx3-ubyte.gz";
  const size_t n = size_t{6} << 20;
  WriteFile(path, GzipWithForgedSize(IdxBytes({0xF0000000u}, ""), n));
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { ReadIdxFile(path); }),
              AllOf(HasSubstr(path + ": corrupt gzip data at compressed byte"), HasSubstr("incorrect length check")));
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, [&] { internal::ReadMaybeGzipFile(path); }),
              AllOf(HasSubstr(path + ": corrupt gzip data at compressed byte"), HasSubstr("incorrect length check")));
}

// Writes `bytes` at `offset` of `path` in place (no truncation, no new
// inode: as a copy over the file does); false when that fails.
bool WriteInPlace(const std::string& path, const std::string& bytes, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset)) ==
                  static_cast<ssize_t>(bytes.size());
  return ::close(fd) == 0 && ok;
}

// Sets the modification time of `path` back to 2000, so that a write
// changes it whatever the clock's resolution.
void AgeFile(const std::string& path) {
  const timespec past[2] = {{946684800, 0}, {946684800, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), past, 0), 0) << path << ": " << std::strerror(errno);
}

// A plain IDX file written in place while read (a copy over the set while
// a rank loads it) may give the header of one version and the data of the
// other: the read fails saying so. Before, it returned the mix without a
// word (a gzip file's CRC catches most such mixes; a plain file has none).
TEST(IdxErrors, APlainFileWrittenToWhileReadIsRefused) {
  const std::string dir = FreshDir("idx_written_while_read");
  const std::string path = dir + "/train-images-idx3-ubyte";
  WriteFile(path, IdxBytes({3, 2, 2}, std::string(12, 'x')));
  AgeFile(path);
  int wrote = -1;
  internal::SetReadAtHookForTesting([&](const std::string& p, uint64_t offset) {
    if (p == path && offset == 16 && wrote < 0) wrote = WriteInPlace(path, std::string(12, 'y'), 16) ? 0 : 1;
  });
  const std::string error = ErrorOf([&] { ReadIdxFile(path); });
  internal::SetReadAtHookForTesting({});
  ASSERT_EQ(wrote, 0) << "the read never reached the data, or the write failed";
  EXPECT_EQ(error, path + ": the file was written to while read (its modification time changed): what was read "
                          "may mix two versions of it; load it again once its writer is done");
  EXPECT_EQ(ReadIdxFile(path).data, std::vector<uint8_t>(12, 'y')) << "read again once the writer is done";

  // Read whole (ReadMaybeGzipFile): the same.
  AgeFile(path);
  wrote = -1;
  internal::SetReadAtHookForTesting([&](const std::string& p, uint64_t offset) {
    if (p == path && offset == 0 && wrote < 0) wrote = WriteInPlace(path, std::string(12, 'z'), 16) ? 0 : 1;
  });
  EXPECT_THAT(ErrorOf([&] { internal::ReadMaybeGzipFile(path); }),
              HasSubstr(path + ": the file was written to while read (its modification time changed)"));
  internal::SetReadAtHookForTesting({});
  EXPECT_EQ(wrote, 0);
}

// A gzip IDX file written in place while read fails its inflate or its
// CRC: that is said as the write it is, not as corrupt data (which sent
// the user to download a good file again). Its reads: the magic, the
// trailer's size, then the stream, before which the write comes.
TEST(IdxErrors, AGzipFileWrittenToWhileReadIsNamedAsSuch) {
  const std::string dir = FreshDir("idx_gz_written_while_read");
  const std::string path = dir + "/train-images-idx3-ubyte.gz";
  const std::string gz = Gzip(IdxBytes({3, 2, 2}, std::string(12, 'x')));
  WriteFile(path, gz);
  AgeFile(path);
  int reads = 0, wrote = -1;
  internal::SetReadAtHookForTesting([&](const std::string& p, uint64_t) {
    if (p == path && ++reads == 3) wrote = WriteInPlace(path, std::string(gz.size() - 20, '\x55'), 10) ? 0 : 1;
  });
  const std::string error = ErrorOf([&] { ReadIdxFile(path); });
  internal::SetReadAtHookForTesting({});
  ASSERT_EQ(wrote, 0) << "the stream was never read, or the write failed";
  EXPECT_THAT(error, HasSubstr(path + ": the file was written to while read (its modification time changed)"));
}

TEST(OpenFileTest, ReadsAtOffsetsAndNamesWhatIsWrong) {
  const std::string dir = FreshDir("open_file");
  const std::string bytes = Gzip(std::string(10000, 'q'));
  WriteFile(dir + "/f", bytes);
  const internal::OpenFile f(dir + "/f");
  EXPECT_EQ(f.size(), bytes.size());
  std::string got(bytes.size() + 10, '\0');
  EXPECT_EQ(f.ReadAt(got.data(), got.size(), 0), bytes.size()) << "short only at the end";
  EXPECT_EQ(got.substr(0, bytes.size()), bytes);
  EXPECT_EQ(f.ReadAt(got.data(), 4, bytes.size() - 2), 2u);
  EXPECT_EQ(got.substr(0, 2), bytes.substr(bytes.size() - 2));
  WriteFile(dir + "/empty", "");
  EXPECT_EQ(internal::OpenFile(dir + "/empty").size(), 0u);
  EXPECT_EQ(internal::ReadMaybeGzipFile(dir + "/f"), std::string(10000, 'q'));
  EXPECT_EQ(internal::ReadMaybeGzipFile(dir + "/empty"), "");
  WriteFile(dir + "/plain", "not gzip");
  EXPECT_EQ(internal::ReadMaybeGzipFile(dir + "/plain"), "not gzip");
  EXPECT_THAT(ErrorOf([&] { internal::OpenFile g(dir + "/nope"); }),
              AllOf(HasSubstr(dir + "/nope"), HasSubstr("cannot open"), HasSubstr("No such file")));
  EXPECT_THAT(ErrorOf([&] { internal::OpenFile g(dir); }), AllOf(HasSubstr(dir), HasSubstr("not a regular file")));
}

// A source file cut short while it is being read (`curl -o` overwriting the
// set in place while a rank loads it) gives a DatasetError naming the file, or
// the whole file's bytes, never a SIGBUS: a reader loads the file while
// another thread keeps truncating it to half and writing the half back, in a
// child process so that a signal fails this test instead of killing it.
TEST(IdxFileTruncatedWhileRead, GivesAnErrorOrTheWholeFileNeverASignal) {
  const std::string dir = FreshDir("truncated");
  const std::string path = dir + "/images.gz";
  // 16 MiB of low-entropy noise: ~8 MiB compressed, tens of ms to inflate.
  std::string pixels(16 << 20, '\0');
  uint64_t x = 88172645463325252ull;
  for (char& c : pixels) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x & 15);
  }
  const std::string file = Gzip(IdxBytes({16, 1024, 1024}, pixels));
  WriteFile(path, file);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::atomic<bool> done{false};
    std::thread truncator([&] {
      const int fd = ::open(path.c_str(), O_WRONLY);
      const size_t half = file.size() / 2;
      while (!done.load()) {
        if (::ftruncate(fd, static_cast<off_t>(half)) != 0) ::_exit(3);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (::pwrite(fd, file.data() + half, file.size() - half, static_cast<off_t>(half)) !=
            static_cast<ssize_t>(file.size() - half)) {
          ::_exit(3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      ::close(fd);
    });
    int wrong = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < until) {
      try {
        const IdxArray a = ReadIdxFile(path);
        wrong += a.data.size() != pixels.size() || std::memcmp(a.data.data(), pixels.data(), pixels.size()) != 0;
      } catch (const DatasetError& e) {
        wrong += std::string(e.what()).find(path) == std::string::npos;
      }
    }
    done = true;
    truncator.join();
    ::_exit(wrong == 0 ? 0 : 1);
  }
  // The child reads for 2 s; killed past 30 s (the test fails so).
  const int status = WaitChild(pid, std::chrono::seconds(30));
  if (status == -1) return;  // killed at the deadline: WaitChild has failed the test, naming the child
  ASSERT_FALSE(WIFSIGNALED(status)) << "the reader died of signal " << WTERMSIG(status)
                                    << " (" << ::strsignal(WTERMSIG(status)) << ")";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 3) << "the test could not truncate " << path;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a load gave wrong bytes or an error not naming " << path;
}

TEST(IdxDatasetErrors, LabelCountDiffersFromImageCount) {
  const std::string dir = FreshDir("idx_count");
  WriteFile(dir + "/im", IdxBytes({3, 1, 1}, "abc"));
  WriteFile(dir + "/lb", IdxBytes({2}, std::string("\x00\x01", 2)));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              AllOf(HasSubstr("has 2 labels"), HasSubstr("has 3 images")));
}

TEST(IdxDatasetErrors, LabelOutOfRange) {
  const std::string dir = FreshDir("idx_label");
  WriteFile(dir + "/im", IdxBytes({3, 1, 1}, "abc"));
  WriteFile(dir + "/lb", IdxBytes({3}, std::string("\x00\x0a\x01", 3)));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              AllOf(HasSubstr(dir + "/lb"), HasSubstr("label 10 of sample 1"),
                    HasSubstr("[0, 10) (at byte 9 of the IDX data")));
}

TEST(IdxDatasetErrors, ImageFileWithWrongRank) {
  const std::string dir = FreshDir("idx_rank");
  WriteFile(dir + "/im", IdxBytes({3}, "abc"));
  WriteFile(dir + "/lb", IdxBytes({3}, std::string("\x00\x01\x01", 3)));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              AllOf(HasSubstr(dir + "/im"), HasSubstr("expected 3 ([N, H, W])")));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/lb", dir + "/im", 10); }),
              HasSubstr("image file has 1 dimensions"));
}

TEST(IdxDatasetErrors, LabelFileWithWrongRank) {
  const std::string dir = FreshDir("idx_lrank");
  WriteFile(dir + "/im", IdxBytes({2, 1, 1}, "ab"));
  WriteFile(dir + "/lb", IdxBytes({2, 1}, std::string("\x00\x01", 2)));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              AllOf(HasSubstr(dir + "/lb"), HasSubstr("label file has 2 dimensions, expected 1 ([N])")));
}

// The label file's rank is checked at its header, before its data is read
// or inflated: an image file given as the labels (files swapped) fails
// there, naming the rank, even where its data is cut short or its gzip
// stream broken. Before, the whole file was read first, and these failed
// as truncated data instead.
TEST(IdxDatasetErrors, LabelFileOfAnotherRankFailsAtItsHeader) {
  const std::string dir = FreshDir("idx_lrank_header");
  const std::string images = IdxBytes({2, 2, 2}, "abcdefgh");
  WriteFile(dir + "/im", images);
  const std::string cut = images.substr(0, images.size() - 3);
  WriteFile(dir + "/lb", cut);
  WriteFile(dir + "/lb.gz", Gzip(cut));
  const std::string gz = Gzip(images);
  WriteFile(dir + "/broken.gz", gz.substr(0, gz.size() - 4));
  for (const std::string name : {"lb", "lb.gz", "broken.gz"}) {
    EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/" + name, 10); }),
                AllOf(HasSubstr(dir + "/" + name), HasSubstr("label file has 3 dimensions, expected 1 ([N])")))
        << name;
  }
}

TEST(IdxDatasetErrors, EmptyImageShape) {
  const std::string dir = FreshDir("idx_empty");
  WriteFile(dir + "/im", IdxBytes({2, 0, 5}, ""));
  WriteFile(dir + "/lb", IdxBytes({2}, std::string("\x00\x01", 2)));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              HasSubstr("is empty"));
}

TEST(IdxDatasetErrors, NoImages) {
  const std::string dir = FreshDir("idx_none");
  WriteFile(dir + "/im", IdxBytes({0, 28, 28}, ""));
  WriteFile(dir + "/lb", IdxBytes({0}, ""));
  EXPECT_THAT(ErrorOf([&] { LoadIdxDataset("d", dir + "/im", dir + "/lb", 10); }),
              AllOf(HasSubstr(dir + "/im"), HasSubstr("holds no images")));
}

}  // namespace
}  // namespace ddp::nn::data
