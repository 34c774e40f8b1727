#include "nn/data/cifar.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "nn/data/file_bytes.h"
#include "nn/data/test_files.h"

namespace ddp::nn::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::ErrorWithinAddressSpace;
using testing::FreshDir;
using testing::WriteFile;

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

// `n` records; record i has label (first_label + i) % 10 and every pixel of
// channel c equal to (i + 10 * c + first_label) % 256.
std::string Records(int n, int first_label) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    s.push_back(static_cast<char>((first_label + i) % 10));
    for (int c = 0; c < 3; ++c) s.append(1024, static_cast<char>((i + 10 * c + first_label) % 256));
  }
  return s;
}

void WriteCifarDir(const std::string& dir) {
  for (int b = 1; b <= 5; ++b) WriteFile(dir + "/data_batch_" + std::to_string(b) + ".bin", Records(4, b));
  WriteFile(dir + "/test_batch.bin", Records(3, 7));
}

TEST(Cifar10, ReadsTrainingBatchesInOrder) {
  const std::string dir = FreshDir("cifar_ok");
  WriteCifarDir(dir);
  auto train = LoadCifar10(dir, Split::kTrain);
  ASSERT_EQ(train->Size(), 20);
  EXPECT_EQ(train->Shape(), (ImageShape{3, 32, 32}));
  EXPECT_EQ(train->NumClasses(), 10);
  // Sample 5 is record 1 of data_batch_2.bin.
  EXPECT_EQ(train->Label(5), 3);
  const uint8_t* px = train->Pixels(5);
  EXPECT_EQ(px[0], 3);
  EXPECT_EQ(px[1023], 3);
  EXPECT_EQ(px[1024], 13);  // green plane
  EXPECT_EQ(px[3071], 23);  // blue plane
  auto test = LoadCifar10(dir, Split::kTest);
  ASSERT_EQ(test->Size(), 3);
  EXPECT_EQ(test->Label(2), 9);
}

TEST(Cifar10, FindsTheUnpackedArchiveFolder) {
  const std::string dir = FreshDir("cifar_sub");
  ASSERT_EQ(::mkdir((dir + "/cifar-10-batches-bin").c_str(), 0755), 0);
  WriteCifarDir(dir + "/cifar-10-batches-bin");
  EXPECT_EQ(LoadCifar10(dir, Split::kTrain)->Size(), 20);
}

TEST(Cifar10Errors, MissingFolderNamesBothPlacesAndDataDir) {
  const std::string dir = FreshDir("cifar_missing");
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              AllOf(HasSubstr(dir + "/data_batch_1.bin"),
                    HasSubstr(dir + "/cifar-10-batches-bin/data_batch_1.bin"),
                    HasSubstr("--data_dir"), HasSubstr("synthetic")));
}

// A folder by a batch's name is said to be one.
TEST(Cifar10Errors, AFolderByABatchsNameIsNamedAsOne) {
  const std::string dir = FreshDir("cifar_folder");
  ASSERT_EQ(::mkdir((dir + "/data_batch_1.bin").c_str(), 0755), 0);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              HasSubstr("(" + dir + "/data_batch_1.bin is a folder)"));
  const std::string later = FreshDir("cifar_later_folder");
  WriteCifarDir(later);
  ASSERT_EQ(std::remove((later + "/data_batch_4.bin").c_str()), 0);
  ASSERT_EQ(::mkdir((later + "/data_batch_4.bin").c_str(), 0755), 0);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(later, Split::kTrain); }),
              HasSubstr("(" + later + "/data_batch_4.bin is a folder)"));
}

TEST(Cifar10Errors, MissingLaterBatch) {
  const std::string dir = FreshDir("cifar_partial");
  WriteCifarDir(dir);
  ASSERT_EQ(std::remove((dir + "/data_batch_4.bin").c_str()), 0);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              HasSubstr(dir + "/data_batch_4.bin"));
}

TEST(Cifar10Errors, TruncatedRecord) {
  const std::string dir = FreshDir("cifar_trunc");
  WriteCifarDir(dir);
  WriteFile(dir + "/test_batch.bin", Records(3, 0).substr(0, 3 * 3073 - 100));
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTest); }),
              AllOf(HasSubstr(dir + "/test_batch.bin"), HasSubstr("truncated"),
                    HasSubstr("last record has 2973 bytes")));
}

// Files of another kind under a batch's name are named as that kind, with
// what to get instead (each was called a truncated CIFAR-10 batch).
TEST(Cifar10Errors, Cifar100BatchIsNamedAsCifar100) {
  const std::string dir = FreshDir("cifar_100");
  WriteCifarDir(dir);
  std::string records;
  for (int i = 0; i < 3; ++i) {
    records.push_back(static_cast<char>(i));       // coarse label
    records.push_back(static_cast<char>(40 + i));  // fine label
    // Pixels of 10 and more: where CIFAR-10's labels would be, they are none
    // (pixels below 10 would fit both kinds: see the next test).
    records.append(3072, static_cast<char>(100 + i));
  }
  WriteFile(dir + "/test_batch.bin", records);
  const std::string error = ErrorOf([&] { LoadCifar10(dir, Split::kTest); });
  EXPECT_THAT(error, AllOf(HasSubstr(dir + "/test_batch.bin: looks like CIFAR-100"),
                           HasSubstr("9222 bytes is a whole number of 3074-byte records"),
                           HasSubstr("does not read")));
  EXPECT_THAT(error, ::testing::Not(HasSubstr("truncated")));
}

// A CIFAR-10 batch cut short at a multiple of 3074 bytes is named as a
// truncated CIFAR-10 batch: its labels sit every 3073 bytes, where
// CIFAR-100's would not. Before, any such size whose first byte was a label
// was called CIFAR-100's binary version. Only where the images' bytes are
// tiny, so that both kinds fit the file's start, are both named.
TEST(Cifar10Errors, TruncatedBatchOfCifar100sRecordSizeIsNamedTruncated) {
  const std::string dir = FreshDir("cifar_trunc100");
  WriteCifarDir(dir);
  // Records of pseudo-random pixels, as real images have.
  std::string records;
  uint32_t x = 12345;
  for (int i = 0; i < 30; ++i) {
    records.push_back(static_cast<char>(i % 10));
    for (int j = 0; j < 3072; ++j) {
      x = x * 1664525u + 1013904223u;
      records.push_back(static_cast<char>(x >> 24));
    }
  }
  for (const int records_100 : {3, 25}) {
    const std::string cut = records.substr(0, static_cast<size_t>(records_100) * 3074);
    WriteFile(dir + "/data_batch_1.bin", cut);
    const std::string error = ErrorOf([&] { LoadCifar10(dir, Split::kTrain); });
    EXPECT_THAT(error, HasSubstr(dir + "/data_batch_1.bin: truncated CIFAR-10 batch: " +
                                 std::to_string(cut.size()) + " bytes is not a whole number of 3073-byte records (the "
                                 "last record has " + std::to_string(cut.size() % 3073) + " bytes)"));
    EXPECT_THAT(error, ::testing::Not(HasSubstr("CIFAR-100")));
  }
  // Images of pixels below 10 (Records' first ones): both kinds are said.
  WriteFile(dir + "/data_batch_1.bin", Records(4, 0).substr(0, 3 * 3074));
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              AllOf(HasSubstr("data_batch_1.bin: truncated CIFAR-10 batch: 9222 bytes"),
                    HasSubstr("or CIFAR-100's binary version")));
}

// A text body saved under a batch's name (a server's error message, or an
// HTML page after a UTF-8 byte order mark) is named as not a batch. Before,
// these were called truncated CIFAR-10 batches (or, of a whole number of
// records, said to hold a bad label).
TEST(Cifar10Errors, TextAndBomPrefixedHtmlAreNamedAsNoBatch) {
  const std::string dir = FreshDir("cifar_text");
  WriteCifarDir(dir);
  const std::string page = "\xEF\xBB\xBF<!DOCTYPE html><html><body>" + std::string(900, 'x') + "</body></html>";
  WriteFile(dir + "/test_batch.bin", page);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTest); }),
              HasSubstr(dir + "/test_batch.bin: looks like an HTML page (" + std::to_string(page.size()) + " bytes)"));
  std::vector<uint8_t> px, lb;
  for (const std::string& text : {std::string("{\"error\": \"AccessDenied\", \"code\": 403}\n"),
                                  std::string("403 Forbidden\r\n") + std::string(3073 * 2 - 15, '.')}) {
    SCOPED_TRACE(text.size());
    EXPECT_THAT(ErrorOf([&] { ParseCifar10Batch(text, "b.bin", &px, &lb); }),
                AllOf(HasSubstr("b.bin: looks like a text file (" + std::to_string(text.size()) + " bytes, starting \"" +
                                text.substr(0, text.find_first_of("\r\n")).substr(0, 40) + "\")"),
                      HasSubstr("not a CIFAR-10 batch")));
  }
  // Binary bytes that are no batch either: named by their first byte.
  std::string binary(5000, '\x01');
  binary[0] = static_cast<char>(0xC3);
  EXPECT_THAT(ErrorOf([&] { ParseCifar10Batch(binary, "b.bin", &px, &lb); }),
              HasSubstr("b.bin: not a CIFAR-10 binary batch: its first byte 0xC3 is no label (0-9), and 5000 bytes is "
                        "not a whole number of 3073-byte records"));
  EXPECT_TRUE(px.empty());
  EXPECT_TRUE(lb.empty());
}

TEST(Cifar10Errors, HtmlPageIsNamedAsAFailedDownload) {
  const std::string dir = FreshDir("cifar_html");
  WriteCifarDir(dir);
  const std::string page = "<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n";
  WriteFile(dir + "/data_batch_2.bin", page);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              AllOf(HasSubstr(dir + "/data_batch_2.bin: looks like an HTML page (" +
                              std::to_string(page.size()) + " bytes)"),
                    HasSubstr("failed download"), HasSubstr("cifar-10-binary.tar.gz")));
  // Leading white space, in any case.
  std::vector<uint8_t> px, lb;
  EXPECT_THAT(ErrorOf([&] { ParseCifar10Batch("\r\n  <HTML><head></head></HTML>", "b.bin", &px, &lb); }),
              HasSubstr("b.bin: looks like an HTML page (30 bytes)"));
}

TEST(Cifar10Errors, PythonVersionIsNamedAsSuch) {
  const std::string dir = FreshDir("cifar_pickle");
  WriteCifarDir(dir);
  // The start of a protocol-2 pickle of a dict, as cifar-10-batches-py holds.
  const std::string pickle = std::string("\x80\x02}q\x00(U\x0b" "batch_labelq\x01U", 22) + std::string(5000, 'x');
  WriteFile(dir + "/data_batch_1.bin", pickle);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              AllOf(HasSubstr(dir + "/data_batch_1.bin: looks like CIFAR-10's Python version (a pickle, 5022 bytes)"),
                    HasSubstr("binary version")));
}

// A plain batch of gigabytes that cannot be one fails on its size and first
// bytes, without being read: it was read whole first. The files are
// sparse (8 GiB that take no disk, not a whole number of records) and read
// where 256 MiB more address space is all there is, so that a whole read
// fails to allocate.
TEST(Cifar10Errors, AHugeFileThatIsNoBatchFailsWithoutBeingRead) {
  const std::string dir = FreshDir("cifar_huge");
  WriteCifarDir(dir);
  const std::string path = dir + "/test_batch.bin";
  const auto load = [&] {
    ::setenv("DDP_DATA_CACHE", "off", 1);  // in the child only
    LoadCifar10(dir, Split::kTest);
  };
  WriteFile(path, "<!DOCTYPE html>\n<html><body>");
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, load),
              HasSubstr(path + ": looks like an HTML page (8589934592 bytes)"));
  WriteFile(path, Records(1, 0));
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, load),
              HasSubstr(path + ": truncated CIFAR-10 batch: 8589934592 bytes is not a whole number of 3073-byte "
                               "records (the last record has " +
                               std::to_string((uint64_t{8} << 30) % 3073) + " bytes)"));
  // A gzip batch is decompressed as it is read, and fails where its stream
  // goes wrong (here other bytes than gzip data after the member).
  const std::string gz = testing::Gzip(Records(1, 0));
  WriteFile(path, gz + "junk");
  ASSERT_EQ(::truncate(path.c_str(), off_t{8} << 30), 0) << path << ": " << std::strerror(errno);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20, load),
              HasSubstr(path + ": " + std::to_string((uint64_t{8} << 30) - gz.size()) +
                        " bytes after the gzip data, which ends at compressed byte " + std::to_string(gz.size())));
}

// A gzip batch's trailer states its size, forgeable: forged to 4 GiB - 1 on
// a batch of 6 MB of noise, it asked for a reservation of nearly 4 GiB,
// which where the memory is not there (here 256 MiB more address space)
// failed with a bare std::bad_alloc naming no file. The records now grow
// as they come, and the load fails on the forged size, naming the file.
// A plain batch written in place while read (a copy over the set while a
// rank loads it) may give records of two versions: the load fails saying
// so. Before, it returned the mix without a word. The batch's time is set
// back first, so that the write changes it whatever the clock's resolution.
TEST(Cifar10Errors, APlainBatchWrittenToWhileReadIsRefused) {
  const std::string dir = FreshDir("cifar_written_while_read");
  WriteCifarDir(dir);
  const std::string path = dir + "/test_batch.bin";
  const timespec past[2] = {{946684800, 0}, {946684800, 0}};  // 2000-01-01
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), past, 0), 0) << std::strerror(errno);
  // Its first read is of its head, to check it; the records are read next.
  int reads = 0, wrote = -1;
  internal::SetReadAtHookForTesting([&](const std::string& p, uint64_t) {
    if (p != path || ++reads != 2) return;
    const std::string other = Records(3, 2);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    wrote = ::pwrite(fd, other.data(), other.size(), 0) == static_cast<ssize_t>(other.size()) ? 0 : 1;
    ::close(fd);
  });
  std::string error;
  try {
    LoadCifar10(dir, Split::kTest);
  } catch (const DatasetError& e) {
    error = e.what();
  }
  internal::SetReadAtHookForTesting({});
  ASSERT_EQ(wrote, 0) << "the records were never read, or the write failed";
  EXPECT_THAT(error, HasSubstr(path + ": the file was written to while read (its modification time changed)"));
  EXPECT_EQ(LoadCifar10(dir, Split::kTest)->Label(0), 2) << "loaded again once the writer is done";
}

// A gzip batch written in place while read fails its inflate or its CRC:
// that is said as the write it is, not as corrupt data. The write comes
// before the stream's first read, the second read at its start (the first
// is of its head, to tell gzip).
TEST(Cifar10Errors, AGzipBatchWrittenToWhileReadIsNamedAsSuch) {
  const std::string dir = FreshDir("cifar_gz_written_while_read");
  WriteCifarDir(dir);
  const std::string path = dir + "/test_batch.bin";
  const std::string gz = testing::Gzip(Records(3, 7));
  WriteFile(path, gz);
  const timespec past[2] = {{946684800, 0}, {946684800, 0}};  // 2000-01-01
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), past, 0), 0) << std::strerror(errno);
  int wrote = -1, zero_reads = 0;
  internal::SetReadAtHookForTesting([&](const std::string& p, uint64_t offset) {
    // The stream's first read: the second at 0, after the head's.
    if (p != path || offset != 0 || wrote >= 0 || ++zero_reads < 2) return;
    const std::string other(gz.size() - 20, '\x55');
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    wrote = ::pwrite(fd, other.data(), other.size(), 10) == static_cast<ssize_t>(other.size()) ? 0 : 1;
    ::close(fd);
  });
  std::string error;
  try {
    LoadCifar10(dir, Split::kTest);
  } catch (const DatasetError& e) {
    error = e.what();
  }
  internal::SetReadAtHookForTesting({});
  ASSERT_EQ(wrote, 0) << "the stream was never read, or the write failed";
  EXPECT_THAT(error, HasSubstr(path + ": the file was written to while read (its modification time changed)"));
}

TEST(Cifar10Errors, AForgedGzipSizeMakesNoHugeReservation) {
  const std::string dir = FreshDir("cifar_forged_isize");
  WriteCifarDir(dir);
  const std::string path = dir + "/test_batch.bin";
  std::mt19937 gen(3);
  std::string records(2000 * kCifarRecordBytes, '\0');
  for (size_t i = 0; i < records.size(); ++i) {
    records[i] = static_cast<char>(i % kCifarRecordBytes == 0 ? gen() % 10 : gen());
  }
  std::string gz = testing::Gzip(records);
  for (size_t i = gz.size() - 4; i < gz.size(); ++i) gz[i] = '\xff';
  WriteFile(path, gz);
  EXPECT_THAT(ErrorWithinAddressSpace<DatasetError>(size_t{256} << 20,
                                                    [&] {
                                                      ::setenv("DDP_DATA_CACHE", "off", 1);  // in the child only
                                                      LoadCifar10(dir, Split::kTest);
                                                    }),
              AllOf(HasSubstr(path + ": corrupt gzip data at compressed byte"), HasSubstr("incorrect length check")));
}

// A training set of CIFAR-10's real size (5 x 10000 records, 154 MB) is
// read where 224 MiB more address space is all there is: each batch was
// read whole into a string and then copied, into an array that grew by
// copies, ~460 MB at the peak. The files are sparse: each batch's first
// records, then zeros (records of label 0) that take no disk. What the
// child read comes back as an error's text.
TEST(Cifar10, AFullSizeSetIsReadWithinLittleMoreThanItsSize) {
  const std::string dir = FreshDir("cifar_full");
  WriteCifarDir(dir);
  constexpr int64_t kRecords = 10000;
  for (int b = 1; b <= 5; ++b) {
    const std::string path = dir + "/data_batch_" + std::to_string(b) + ".bin";
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(kRecords * kCifarRecordBytes)), 0)
        << path << ": " << std::strerror(errno);
  }
  const std::string read = ErrorWithinAddressSpace<DatasetError>(size_t{224} << 20, [&] {
    ::setenv("DDP_DATA_CACHE", "off", 1);  // in the child only
    const auto train = LoadCifar10(dir, Split::kTrain);
    int64_t label_sum = 0, pixel_sum = 0;
    for (int64_t i = 0; i < train->Size(); ++i) {
      label_sum += train->Label(i);
      pixel_sum += train->Pixels(i)[0] + train->Pixels(i)[3071];
    }
    throw DatasetError("samples " + std::to_string(train->Size()) + ", sample 10001 has label " +
                       std::to_string(train->Label(10001)) + " and green " +
                       std::to_string(train->Pixels(10001)[1024]) + ", labels sum to " + std::to_string(label_sum) +
                       ", first and last pixels to " + std::to_string(pixel_sum));
  });
  // Batch b's record i (i < 4) has label (b + i) % 10 and pixels
  // (i + 10c + b) % 256 in channel c; the rest are zeros.
  int64_t label_sum = 0, pixel_sum = 0;
  for (int b = 1; b <= 5; ++b) {
    for (int i = 0; i < 4; ++i) {
      label_sum += (b + i) % 10;
      pixel_sum += (i + b) % 256 + (i + 20 + b) % 256;
    }
  }
  EXPECT_EQ(read, "samples 50000, sample 10001 has label 3 and green 13, labels sum to " + std::to_string(label_sum) +
                      ", first and last pixels to " + std::to_string(pixel_sum));
}

// A gzip-compressed batch reads as the plain one does, across members and
// over more records than one read takes (256); its errors are the plain
// one's, in the same order: its size first (known at the stream's end),
// then its labels.
TEST(Cifar10, GzipBatchReadsAsThePlainOneDoes) {
  const std::string plain = FreshDir("cifar_plain"), gz = FreshDir("cifar_gz");
  WriteCifarDir(plain);
  WriteCifarDir(gz);
  const std::string records = Records(300, 7);
  WriteFile(plain + "/test_batch.bin", records);
  WriteFile(gz + "/test_batch.bin", testing::Gzip(records.substr(0, 1000)) + testing::Gzip(records.substr(1000)));
  const auto a = LoadCifar10(plain, Split::kTest), b = LoadCifar10(gz, Split::kTest);
  ASSERT_EQ(a->Size(), 300);
  ASSERT_EQ(b->Size(), 300);
  for (int64_t i = 0; i < 300; ++i) {
    ASSERT_EQ(b->Label(i), a->Label(i)) << "sample " << i;
    ASSERT_EQ(std::memcmp(b->Pixels(i), a->Pixels(i), 3072), 0) << "sample " << i;
  }
  const std::string path = gz + "/test_batch.bin";
  std::string bad = records;
  bad[280 * 3073] = 12;
  WriteFile(path, testing::Gzip(bad));
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(gz, Split::kTest); }),
              HasSubstr(path + ": label 12 of record 280 is out of range [0, 10) (at byte " +
                        std::to_string(280 * 3073) + " of the decompressed data)"));
  // The plain file's offset is the file's own.
  WriteFile(plain + "/test_batch.bin", bad);
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(plain, Split::kTest); }),
              HasSubstr(plain + "/test_batch.bin: label 12 of record 280 is out of range [0, 10) (at byte " +
                        std::to_string(280 * 3073) + ")"));
  WriteFile(path, testing::Gzip(bad.substr(0, bad.size() - 5)));
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(gz, Split::kTest); }),
              HasSubstr(path + ": truncated CIFAR-10 batch: " + std::to_string(bad.size() - 5) +
                        " bytes is not a whole number of 3073-byte records (the last record has 3068 bytes)"));
  const std::string page = "<!DOCTYPE html>\n<html><body>" + std::string(10000, 'x') + "</body></html>\n";
  WriteFile(path, testing::Gzip(page));
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(gz, Split::kTest); }),
              HasSubstr(path + ": looks like an HTML page (" + std::to_string(page.size()) + " bytes)"));
}

TEST(Cifar10Errors, EmptyFile) {
  const std::string dir = FreshDir("cifar_empty");
  WriteCifarDir(dir);
  WriteFile(dir + "/data_batch_3.bin", "");
  EXPECT_THAT(ErrorOf([&] { LoadCifar10(dir, Split::kTrain); }),
              AllOf(HasSubstr(dir + "/data_batch_3.bin"), HasSubstr("empty file")));
}

TEST(Cifar10Errors, LabelOutOfRange) {
  std::string bytes = Records(3, 0);
  bytes[2 * 3073] = 10;
  std::vector<uint8_t> px, lb;
  EXPECT_THAT(ErrorOf([&] { ParseCifar10Batch(bytes, "b.bin", &px, &lb); }),
              AllOf(HasSubstr("b.bin"), HasSubstr("label 10 of record 2 is out of range [0, 10) (at byte 6146)")));
  EXPECT_TRUE(px.empty());
  EXPECT_TRUE(lb.empty());
}

}  // namespace
}  // namespace ddp::nn::data
