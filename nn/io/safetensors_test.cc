#include "nn/io/safetensors.h"
#include "nn/io/testing/io_test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <system_error>
#include <thread>

#include "nn/io/atomic_file.h"

namespace ddp::nn::io {
namespace {

using test_util::ErrorOf;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TmpDir(const std::string& tag) {
  static int counter = 0;
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + tag + "_" + std::to_string(getpid()) +
                    "_" + std::to_string(counter++);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  while (dirent* e = d ? readdir(d) : nullptr) {
    if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.push_back(e->d_name);
  }
  if (d) closedir(d);
  return names;
}

// Owned test tensors with random bytes (every bit pattern, NaNs included).
struct Sample {
  std::vector<std::string> names;
  std::vector<StDtype> dtypes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::string> bytes;

  void Add(std::string name, StDtype dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = StDtypeSize(dtype);
    for (int64_t d : shape) n *= d;
    std::string b(n, '\0');
    for (char& c : b) c = static_cast<char>(rng());
    names.push_back(std::move(name));
    dtypes.push_back(dtype);
    shapes.push_back(std::move(shape));
    bytes.push_back(std::move(b));
  }
  std::vector<TensorView> Views() const {
    std::vector<TensorView> v;
    for (size_t i = 0; i < names.size(); ++i) {
      v.push_back({names[i], dtypes[i], shapes[i], bytes[i].data(), bytes[i].size()});
    }
    return v;
  }
};

Sample EveryDtype() {
  std::mt19937_64 rng(1);
  Sample s;
  const StDtype all[] = {StDtype::kF32, StDtype::kF64, StDtype::kF16, StDtype::kBF16,
                         StDtype::kI64, StDtype::kI32, StDtype::kU8};
  int i = 0;
  for (StDtype d : all) {
    s.Add(std::string("t.") + StDtypeName(d), d, {3, 5}, rng);
    s.Add(std::string("scalar.") + StDtypeName(d), d, {}, rng);
    s.Add(std::string("odd.") + StDtypeName(d), d, {1, 7, 1, 3 + i++}, rng);
  }
  s.Add("empty", StDtype::kF32, {0, 4}, rng);
  return s;
}

void ExpectSame(const SafetensorsFile& f, const Sample& s) {
  ASSERT_EQ(f.tensors().size(), s.names.size());
  for (size_t i = 0; i < s.names.size(); ++i) {
    const TensorEntry* e = f.Find(s.names[i]);
    ASSERT_NE(e, nullptr) << s.names[i];
    EXPECT_EQ(e->dtype, s.dtypes[i]);
    EXPECT_EQ(e->shape, s.shapes[i]);
    ASSERT_EQ(e->nbytes, s.bytes[i].size());
    EXPECT_EQ(std::memcmp(f.Data(*e), s.bytes[i].data(), e->nbytes), 0) << s.names[i];
  }
}

TEST(Safetensors, RoundTripIsBitExactForEveryDtype) {
  const Sample s = EveryDtype();
  const std::string dir = TmpDir("st_rt");
  WriteSafetensorsFile(dir + "/m.safetensors", s.Views(), {{"epoch", "4"}, {"note", "é ✓"}});
  SafetensorsFile f = SafetensorsFile::Read(dir + "/m.safetensors");
  ExpectSame(f, s);
  EXPECT_EQ(f.metadata(), (Metadata{{"epoch", "4"}, {"note", "é ✓"}}));
  // The header lists the entries in the order they were written.
  ASSERT_EQ(f.header_order().size(), s.names.size());
  for (size_t i = 0; i < s.names.size(); ++i) EXPECT_EQ(f.tensors()[f.header_order()[i]].name, s.names[i]);
  // Same bytes through the in-memory path; the data region starts 8-aligned.
  const std::string bytes = SerializeSafetensors(s.Views(), {{"epoch", "4"}, {"note", "é ✓"}});
  EXPECT_EQ(bytes, ReadAll(dir + "/m.safetensors"));
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"m.safetensors"});
}

TEST(Safetensors, EmptyFileHoldsOnlyMetadata) {
  SafetensorsFile f = SafetensorsFile::Parse(SerializeSafetensors({}, {}), "mem");
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());
}

// The checksum key's text inside a user's metadata key (its quote escaped)
// is not the checksum entry: the writer must not overwrite it.
TEST(Safetensors, ChecksumKeyTextInsideAUserKeyIsLeftAlone) {
  const Metadata user{{"a\"ddp.header_crc32", "v"}, {"b", "x\"ddp.header_crc32\":\"12345678"}};
  const std::string bytes = SerializeSafetensors({}, user);
  SafetensorsFile f = SafetensorsFile::Parse(bytes, "mem");
  EXPECT_EQ(f.metadata(), user);
}

// A header whose metadata holds the checksum key that the scan never found
// at a key position was not checked: refused.
TEST(Safetensors, ChecksumKeyInMetadataOnlyUnderAnEscapeIsRefused) {
  // Written by hand: the key spelled with a \u escape, so the text scan
  // cannot see it, though the parsed metadata holds it.
  std::string header = R"({"__metadata__":{"ddp.header\u005fcrc32":"00000000"}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(bytes.data(), &n, 8);
  bytes += header;
  try {
    SafetensorsFile::Parse(bytes, "mem");
    FAIL() << "parsed";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("mem"), HasSubstr("ddp.header_crc32")));
  }
}

// A header over kMaxHeaderBytes would be refused by every reader: the
// writer refuses it before creating anything at the path.
TEST(Safetensors, HeaderOverTheLimitIsRefusedBeforeWriting) {
  const std::string dir = TmpDir("st_big_header");
  const Metadata big{{"blob", std::string(100'000'001, 'x')}};
  try {
    WriteSafetensorsFile(dir + "/m.safetensors", {}, big);
    FAIL() << "written";
  } catch (const CheckpointError& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(dir + "/m.safetensors"), HasSubstr("100000000"),
                                HasSubstr("header is 1000")));
  }
  EXPECT_TRUE(FilesIn(dir).empty());
  EXPECT_THROW(SerializeSafetensors({}, big), std::invalid_argument);
}

// Bytes this process has read through read(2) and the like, or -1.
int64_t BytesReadSoFar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

// A valid file followed by a 1 GiB tail (sparse, so cheap to make) is
// refused from its header and size alone: the tail is neither allocated
// nor read.
TEST(Safetensors, HugeTailAfterTheLastTensorIsRefusedWithoutReadingIt) {
  const std::string dir = TmpDir("st_tail");
  const std::string path = dir + "/t.safetensors";
  const float a = 1;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {1}, &a, 4}});
  const uint64_t good = ReadAll(path).size();
  const uint64_t tail = uint64_t{1} << 30;
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(good + tail)), 0) << std::strerror(errno);
  const int64_t read_before = BytesReadSoFar();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { SafetensorsFile::Read(path); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t read_after = BytesReadSoFar();
  EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("bytes [4, " + std::to_string(4 + tail) + ")"),
                           HasSubstr(std::to_string(tail) + " trailing bytes")));
  EXPECT_LT(seconds, 1.0);
  if (read_before >= 0 && read_after >= 0) {
    EXPECT_LT(read_after - read_before, 1 << 20);
  }
  // The same file without its tail reads.
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(good)), 0);
  EXPECT_EQ(SafetensorsFile::Read(path).tensors().size(), 1u);
}

// For a header that is not valid, ReadBytes returns the length and the
// header only, which Parse refuses as it refuses the whole file (on every
// rank that gets them).
TEST(Safetensors, ReadBytesGivesParseOnlyTheInvalidHeader) {
  const std::string path = TmpDir("st_bad_header") + "/b.safetensors";
  const std::string bad = std::string("\x02\0\0\0\0\0\0\0[]", 10) + std::string(64, 'd');
  WriteAll(path, bad);
  const std::string from_parse = ErrorOf([&] { SafetensorsFile::Parse(bad, path); });
  EXPECT_THAT(from_parse, HasSubstr("does not start with"));
  const std::string bytes = SafetensorsFile::ReadBytes(path);
  EXPECT_EQ(bytes, bad.substr(0, 10));
  EXPECT_EQ(ErrorOf([&] { SafetensorsFile::Parse(bytes, path); }), from_parse);
}

// A huge file (sparse: 1 TiB that takes no disk) whose length field is
// valid but whose header is corrupt fails at once, naming the header, not
// after trying to hold or read the whole file.
TEST(Safetensors, CorruptHeaderOfAHugeFileFailsBeforeItsDataIsRead) {
  const std::string path = TmpDir("st_huge_bad_header") + "/h.safetensors";
  std::string header = "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  WriteAll(path, bytes + header);
  ASSERT_EQ(::truncate(path.c_str(), off_t{1} << 40), 0) << std::strerror(errno);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = ErrorOf([&] { SafetensorsFile::Read(path); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("header is not valid JSON")));
  EXPECT_EQ(SafetensorsFile::ReadBytes(path), bytes + header);
  ::unlink(path.c_str());
}

// A header whose tensors end past the file's end is refused the same way:
// here only the last tensor is cut, and the message names it.
TEST(Safetensors, DataCutShortInTheLastTensorIsRefusedNamingIt) {
  const std::string dir = TmpDir("st_cut");
  const std::string path = dir + "/t.safetensors";
  const float a[2] = {1, 2};
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {1}, a, 4}, {"y", StDtype::kF32, {1}, a + 1, 4}});
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(ReadAll(path).size() - 2)), 0);
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }),
              AllOf(HasSubstr(path), HasSubstr("tensor `y`"), HasSubstr("truncated file?")));
}

// A file cut in the middle of its data: the readers of a path name the
// first tensor whose bytes are missing, as Parse does for the same bytes.
// Before, Read and ReadInto named the tensor that ends last (`z` here),
// which suggested the tensors before it were whole.
TEST(Safetensors, TruncatedDataIsRefusedNamingTheFirstTensorCut) {
  const std::string path = TmpDir("st_cut_mid") + "/t.safetensors";
  const float a[3] = {1, 2, 3};
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {1}, a, 4},
                              {"y", StDtype::kF32, {1}, a + 1, 4},
                              {"z", StDtype::kF32, {1}, a + 2, 4}});
  const std::string whole = ReadAll(path);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(whole.size() - 6)), 0);  // 2 bytes of y left
  const std::string expected = "tensor `y`: data_offsets [4, 8] extend past the 6-byte data region (truncated file?)";
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Parse(whole.substr(0, whole.size() - 6), path); }),
              AllOf(HasSubstr(path), HasSubstr(expected)));
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }), AllOf(HasSubstr(path), HasSubstr(expected)));
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadBytes(path); }), AllOf(HasSubstr(path), HasSubstr(expected)));
  EXPECT_THAT(ErrorOf([&] {
                SafetensorsFile::ReadInto(path, [](const SafetensorsFile& f) {
                  return std::vector<void*>(f.tensors().size(), nullptr);
                });
              }),
              AllOf(HasSubstr(path), HasSubstr(expected)));
}

// An empty file and a directory at the path: every reader of a path gives
// one error naming the path and what is wrong. A review probe; these
// already behaved.
TEST(Safetensors, AnEmptyFileOrADirectoryIsRefusedByEveryReaderNamingThePath) {
  const std::string dir = TmpDir("st_not_a_file");
  const std::string empty = dir + "/empty.safetensors";
  WriteAll(empty, "");
  const std::string folder = dir + "/folder.safetensors";
  ASSERT_EQ(::mkdir(folder.c_str(), 0755), 0) << std::strerror(errno);
  const auto nowhere = [](const SafetensorsFile& f) { return std::vector<void*>(f.tensors().size(), nullptr); };
  for (const auto& [path, says] : {std::pair<std::string, std::string>{empty, "file is 0 bytes, shorter than the "
                                                                              "8-byte header length"},
                                   std::pair<std::string, std::string>{folder, "not a regular file but a directory"}}) {
    SCOPED_TRACE(path);
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }), AllOf(HasSubstr(path), HasSubstr(says)));
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadInto(path, nowhere); }), AllOf(HasSubstr(path), HasSubstr(says)));
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadMetadata(path); }), AllOf(HasSubstr(path), HasSubstr(says)));
  }
}

// A name that is not valid UTF-8 cannot be written or printed: the error
// gives the file and the tensor's place.
TEST(Safetensors, NameThatCannotBeEncodedIsNamedByItsPlace) {
  const std::string dir = TmpDir("st_utf8");
  const float a = 1;
  EXPECT_THAT(ErrorOf([&] {
                WriteSafetensorsFile(dir + "/m.safetensors", {{"ok", StDtype::kF32, {}, &a, 4},
                                                              {"w\xff", StDtype::kF32, {}, &a, 4}});
              }),
              AllOf(HasSubstr(dir + "/m.safetensors"), HasSubstr("tensor #1's name")));
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(dir + "/m.safetensors", {}, {{"k", "v\xff"}}); }),
              HasSubstr("metadata value of `k`"));
  EXPECT_TRUE(FilesIn(dir).empty());
}

// A very long name is cut in messages, its length given.
TEST(Safetensors, LongNamesAreCutInMessages) {
  const std::string name(100'000, 'n');
  const float a = 1;
  const std::string error = ErrorOf([&] {
    WriteSafetensorsFile(TmpDir("st_long") + "/m.safetensors",
                         {{name, StDtype::kF32, {}, &a, 4}, {name, StDtype::kF32, {}, &a, 4}});
  });
  EXPECT_THAT(error, AllOf(HasSubstr("appears twice"), HasSubstr("... (100000 bytes)")));
  EXPECT_LT(error.size(), 1000u);
  EXPECT_EQ(NameForMessage("short"), "short");
  // Cut before a character, not inside it.
  const std::string wide = std::string(199, 'x') + "\xc3\xa9" + "tail";
  EXPECT_EQ(NameForMessage(wide), std::string(199, 'x') + "... (205 bytes)");
}

// A file made with Python's json and struct modules the way other writers
// make them: header keys out of data order, unaligned data, no checksum.
TEST(Safetensors, ReadsAFileWrittenByPython) {
  SafetensorsFile f = SafetensorsFile::Read("nn/io/testdata/python_written.safetensors");
  EXPECT_EQ(f.metadata(), (Metadata{{"format", "pt"}, {"epoch", "3"}}));
  ASSERT_EQ(f.tensors().size(), 8u);
  EXPECT_EQ(f.tensors()[0].name, "layer.weight");
  const TensorEntry* w = f.Find("layer.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  float wv[6];
  std::memcpy(wv, f.Data(*w), 24);
  EXPECT_EQ(wv[0], 1.5f);
  EXPECT_EQ(wv[5], 1e-3f);
  EXPECT_TRUE(std::signbit(wv[4]));
  const TensorEntry* step = f.Find("step");
  ASSERT_NE(step, nullptr);
  EXPECT_TRUE(step->shape.empty());
  int64_t sv;
  std::memcpy(&sv, f.Data(*step), 8);
  EXPECT_EQ(sv, -7);
  const TensorEntry* ints = f.Find("ints");
  int32_t iv[4];
  std::memcpy(iv, f.Data(*ints), 16);
  EXPECT_EQ(iv[3], INT32_MIN);
  const TensorEntry* brain = f.Find("brain");
  EXPECT_EQ(brain->dtype, StDtype::kBF16);
  uint16_t bv[2];
  std::memcpy(bv, f.Data(*brain), 4);
  EXPECT_EQ(bv[1], 0xC040);
  EXPECT_EQ(f.Find("empty")->nbytes, 0u);
}

// Every tensor's data starts at a multiple of its element size, as in the
// reference writer's files, so that it can be used in place (mapped
// memory, a zero-copy view). Before, the data went in the order given: the
// F32 tensor after 3 BF16 elements started 2 bytes off alignment. The
// header still lists the tensors in the order given.
TEST(Safetensors, EveryTensorStartsAtAMultipleOfItsElementSize) {
  const uint16_t bf[3] = {1, 2, 3};
  const float f32[2] = {1.5f, -2.5f};
  const uint8_t u8[1] = {7};
  const double f64[1] = {0.125};
  const int16_t i16[3] = {-1, 2, -3};
  const int64_t i64[1] = {-9};
  const std::vector<TensorView> views = {
      {"bf", StDtype::kBF16, {3}, bf, sizeof(bf)},    {"f32", StDtype::kF32, {2}, f32, sizeof(f32)},
      {"u8", StDtype::kU8, {1}, u8, sizeof(u8)},      {"f64", StDtype::kF64, {1}, f64, sizeof(f64)},
      {"i16", StDtype::kI16, {3}, i16, sizeof(i16)},  {"i64", StDtype::kI64, {1}, i64, sizeof(i64)},
  };
  const std::string path = TmpDir("st_aligned") + "/m.safetensors";
  WriteSafetensorsFile(path, views);
  const std::string bytes = SerializeSafetensors(views);
  EXPECT_EQ(bytes, ReadAll(path));
  for (const bool from_file : {false, true}) {
    SCOPED_TRACE(from_file ? "Read" : "Parse");
    const SafetensorsFile f = from_file ? SafetensorsFile::Read(path) : SafetensorsFile::Parse(bytes, "mem");
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    ASSERT_EQ((8 + n) % 8, 0u);
    ASSERT_EQ(f.tensors().size(), views.size());
    for (const TensorEntry& e : f.tensors()) {
      EXPECT_EQ(e.offset % StDtypeSize(e.dtype), 0u) << e.name << " starts at " << e.offset;
    }
    ASSERT_EQ(f.header_order().size(), views.size());
    for (size_t i = 0; i < views.size(); ++i) {
      const TensorEntry& e = f.tensors()[f.header_order()[i]];
      EXPECT_EQ(e.name, views[i].name);
      ASSERT_EQ(e.nbytes, views[i].nbytes);
      EXPECT_EQ(std::memcmp(f.Data(e), views[i].data, e.nbytes), 0) << e.name;
    }
  }
}

// A file whose data is in the order its header lists (as this writer made
// them before, unaligned) still loads, its entries listed in that order.
TEST(Safetensors, AFileWithUnalignedDataStillLoads) {
  std::string header =
      R"({"bf":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
      R"("f32":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  const uint16_t bf[3] = {4, 5, 6};
  const float value = 3.25f;
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(bf), sizeof(bf));
  bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
  const std::string path = TmpDir("st_unaligned") + "/old.safetensors";
  WriteAll(path, bytes);
  const SafetensorsFile f = SafetensorsFile::Read(path);
  ASSERT_EQ(f.header_order().size(), 2u);
  EXPECT_EQ(f.tensors()[f.header_order()[0]].name, "bf");
  EXPECT_EQ(f.tensors()[f.header_order()[1]].name, "f32");
  const TensorEntry* e = f.Find("f32");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->offset, 6u);
  float got = 0;
  std::memcpy(&got, f.Data(*e), sizeof(got));
  EXPECT_EQ(got, value);
}

// The file below was checked by hand with
// tools/golden/safetensors_interop.py check (Python json + struct, and
// torch.frombuffer); writing the same tensors must still give these bytes.
TEST(Safetensors, WritesTheBytesPythonWasCheckedOn) {
  const float w[6] = {1.5f, -2.0f, 0.25f, 3.0f, -0.0f, 1e-3f};
  const int64_t step = 12345;
  const uint16_t bf[2] = {0x3F80, 0xC040};
  const std::vector<TensorView> views = {
      {"model.fc.weight", StDtype::kF32, {2, 3}, w, sizeof(w)},
      {"optim.step", StDtype::kI64, {}, &step, sizeof(step)},
      {"model.bf", StDtype::kBF16, {2}, bf, sizeof(bf)},
  };
  const std::string bytes = SerializeSafetensors(views, {{"epoch", "2"}});
  if (const char* out = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR")) {
    WriteAll(std::string(out) + "/cpp_written.safetensors", bytes);
  }
  EXPECT_EQ(bytes, ReadAll("nn/io/testdata/cpp_written.safetensors"));
}

// The writer's header takes time linear in the number of tensors. Before,
// each name went into an nlohmann::ordered_json, which looks for a key by
// a linear search: 5.7 s for 40,000 tensors here, on every save of a model
// whose state has that many.
TEST(Safetensors, HeaderOfManyTensorsIsWrittenInLinearTime) {
  constexpr int kTensors = 60000;
  const float value = 1.5f;
  std::vector<TensorView> views;
  for (int i = 0; i < kTensors; ++i) {
    views.push_back({"model.layers." + std::to_string(i) + ".weight", StDtype::kF32, {1}, &value, sizeof(value)});
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string bytes = SerializeSafetensors(views, {{"step", "3"}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);  // about 0.2 s in a debug build
  const SafetensorsFile f = SafetensorsFile::Parse(bytes, "many.safetensors");
  ASSERT_EQ(f.tensors().size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(f.tensors()[kTensors - 1].name, views[kTensors - 1].name);
  EXPECT_EQ(f.tensors()[kTensors - 1].offset, 4u * (kTensors - 1));
  EXPECT_EQ(f.metadata(), (Metadata{{"step", "3"}}));
}

TEST(Safetensors, ReplacesAnExistingFileAtomically) {
  const std::string dir = TmpDir("st_replace");
  const std::string path = dir + "/c.safetensors";
  const float a = 1, b = 2;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &b, 4}});
  SafetensorsFile f = SafetensorsFile::Read(path);
  float v;
  std::memcpy(&v, f.Data(f.tensors()[0]), 4);
  EXPECT_EQ(v, 2.0f);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

float ReadScalar(const std::string& path) {
  SafetensorsFile f = SafetensorsFile::Read(path);
  float v;
  std::memcpy(&v, f.Data(f.tensors()[0]), 4);
  return v;
}

bool IsSymlink(const std::string& path) {
  struct stat st{};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// A save to a symbolic link writes the file it leads to (through a chain of
// links, a relative one among them) and keeps the links, as torch.save
// does. Before, the rename put a regular file in the link's place and the
// target kept the old contents.
TEST(Safetensors, SavingThroughASymlinkReplacesItsTargetAndKeepsTheLink) {
  const std::string dir = TmpDir("st_link");
  const std::string real_dir = TmpDir("st_link_target");
  const std::string target = real_dir + "/real.safetensors";
  const float a = 1, b = 2;
  WriteSafetensorsFile(target, {{"x", StDtype::kF32, {}, &a, 4}});
  ASSERT_EQ(::symlink(target.c_str(), (dir + "/middle").c_str()), 0);
  ASSERT_EQ(::symlink("middle", (dir + "/c.safetensors").c_str()), 0);
  WriteSafetensorsFile(dir + "/c.safetensors", {{"x", StDtype::kF32, {}, &b, 4}});
  EXPECT_TRUE(IsSymlink(dir + "/c.safetensors"));
  EXPECT_TRUE(IsSymlink(dir + "/middle"));
  EXPECT_EQ(ReadScalar(target), 2.0f);
  EXPECT_EQ(ReadScalar(dir + "/c.safetensors"), 2.0f);
  EXPECT_THAT(FilesIn(dir), ::testing::UnorderedElementsAre("c.safetensors", "middle"));
  EXPECT_EQ(FilesIn(real_dir), std::vector<std::string>{"real.safetensors"});
}

// A dangling link names the file to create when that file's folder exists;
// when it does not, or the links loop, the error names the link and where
// it leads, and nothing is written.
TEST(Safetensors, SavingThroughADanglingSymlinkCreatesTheTargetOrNamesBoth) {
  const std::string dir = TmpDir("st_dangling");
  const float a = 3;
  ASSERT_EQ(::symlink("new.safetensors", (dir + "/link").c_str()), 0);
  WriteSafetensorsFile(dir + "/link", {{"x", StDtype::kF32, {}, &a, 4}});
  EXPECT_TRUE(IsSymlink(dir + "/link"));
  EXPECT_EQ(ReadScalar(dir + "/new.safetensors"), 3.0f);

  const std::string missing = dir + "/no_such_folder/c.safetensors";
  ASSERT_EQ(::symlink(missing.c_str(), (dir + "/lost").c_str()), 0);
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(dir + "/lost", {{"x", StDtype::kF32, {}, &a, 4}}); }),
              AllOf(HasSubstr(dir + "/lost"), HasSubstr(missing), HasSubstr("does not exist")));
  EXPECT_TRUE(IsSymlink(dir + "/lost"));

  ASSERT_EQ(::symlink("loop_b", (dir + "/loop_a").c_str()), 0);
  ASSERT_EQ(::symlink("loop_a", (dir + "/loop_b").c_str()), 0);
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(dir + "/loop_a", {{"x", StDtype::kF32, {}, &a, 4}}); }),
              AllOf(HasSubstr(dir + "/loop_a"), HasSubstr("symbolic links in a row")));
  EXPECT_TRUE(IsSymlink(dir + "/loop_a"));
  EXPECT_TRUE(IsSymlink(dir + "/loop_b"));
  EXPECT_THAT(FilesIn(dir),
              ::testing::UnorderedElementsAre("link", "loop_a", "loop_b", "lost", "new.safetensors"));
}

TEST(Safetensors, FailedWriteLeavesTheOldFileAndNoTemporary) {
  const std::string dir = TmpDir("st_fail");
  const std::string path = dir + "/c.safetensors";
  const float a = 1;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  const std::string before = ReadAll(path);
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(path, {{"x", StDtype::kF32, {2}, &a, 4}}); }),
              AllOf(HasSubstr(path), HasSubstr("needs 8 bytes, got 4")));
  EXPECT_THAT(ErrorOf([&] {
                WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}, {"x", StDtype::kF32, {}, &a, 4}});
              }),
              HasSubstr("`x` appears twice"));
  EXPECT_EQ(ReadAll(path), before);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// A write cut short by the disk (here the file size limit: part of the
// bytes written, then EFBIG, as a full disk gives a short write and then
// ENOSPC) leaves a temporary holding part of the data. A caller that
// catches the error and commits anyway (or writes the rest again) gets an
// error, and the old file stays. Before, the Commit renamed the short file
// into place. Run in a child, whose file size limit goes with it.
TEST(Safetensors, ACommitAfterAFailedWriteIsRefused) {
  const std::string dir = TmpDir("st_short_write");
  const std::string path = dir + "/c.bin";
  WriteAll(path, "old");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{4096, 4096};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(10);
    const std::string data(3 * 4096, 'n');
    int code = 0;
    {
      AtomicFileWriter out(path);  // its destructor removes the temporary
      try {
        out.Write(data.data(), data.size());
        code |= 8;  // the limit did not cut the write short
      } catch (const CheckpointError&) {
      }
      try {
        out.Write(data.data(), 1);
        code |= 1;
      } catch (const CheckpointError& e) {
        if (std::string(e.what()).find("earlier write or commit") == std::string::npos) code |= 4;
      }
      try {
        out.Commit();
        code |= 2;
      } catch (const CheckpointError& e) {
        if (std::string(e.what()).find("earlier write or commit") == std::string::npos) code |= 4;
      }
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  // 1: the write after the failure went through; 2: the commit did; 4: an
  // error other than the one saying why; 8: the first write was not cut.
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(ReadAll(path), "old");
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.bin"});
}

// A caller past its deadline (ddp's SaveCheckpoint) sets the stop flag:
// the write ends before its next piece and the old file stays, alone.
TEST(Safetensors, StoppedWriteLeavesTheOldFileAndNoTemporary) {
  const std::string dir = TmpDir("st_stop");
  const std::string path = dir + "/c.safetensors";
  const float a = 1, b = 2;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  const std::string before = ReadAll(path);
  std::atomic<bool> stop{true};
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &b, 4}}, {}, &stop); }),
              AllOf(HasSubstr(path), HasSubstr("the write was stopped before it ended")));
  EXPECT_EQ(ReadAll(path), before);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
  // Stopped between pieces, or just before the commit.
  stop = false;
  {
    AtomicFileWriter out(path, &stop);
    out.Write(&b, 4);
    stop = true;
    EXPECT_THAT(ErrorOf([&] { out.Write(&b, 4); }), HasSubstr("the write was stopped"));
    EXPECT_THAT(ErrorOf([&] { out.Commit(); }), HasSubstr("the write was stopped"));
  }
  EXPECT_EQ(ReadAll(path), before);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// ReadMetadata reads the header alone: a file whose data region is damaged
// (which Read refuses) still gives its metadata, as Read gives it for an
// intact one; a damaged header is an error naming the file.
TEST(SafetensorsTest, ReadMetadataReadsTheHeaderAlone) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/metadata_only.safetensors";
  const std::vector<float> w(1000, 1.5f);
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1000}, w.data(), w.size() * sizeof(float)}},
                       {{"step", "7"}, {"job", "a"}});
  const Metadata whole = SafetensorsFile::Read(path).metadata();
  EXPECT_EQ(SafetensorsFile::ReadMetadata(path), whole);
  EXPECT_EQ(whole, (Metadata{{"step", "7"}, {"job", "a"}}));

  std::string bytes = SafetensorsFile::ReadBytes(path);
  bytes[bytes.size() - 1] ^= 0x55;  // the data region's last byte
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_THROW(SafetensorsFile::Read(path), CheckpointError);
  EXPECT_EQ(SafetensorsFile::ReadMetadata(path), whole);

  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, 20);
  try {
    SafetensorsFile::ReadMetadata(path);
    ADD_FAILURE() << "no error for a cut header";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ": invalid safetensors file: header length ", 0), 0u)
        << e.what();
  }
}

// A folder's fsync that the filesystem does not do (after the rename put
// the file in place) is no failed save; other errors still are.
TEST(AtomicFileTest, FolderFsyncTheFilesystemDoesNotDoIsNoError) {
  for (const int err : {EINVAL, ENOTSUP, EOPNOTSUPP, EBADF, EROFS}) {
    EXPECT_TRUE(internal::FolderFsyncUnsupported(err)) << std::strerror(err);
  }
  for (const int err : {EIO, ENOSPC, EDQUOT, EINTR, 0}) {
    EXPECT_FALSE(internal::FolderFsyncUnsupported(err)) << std::strerror(err);
  }
  // An ordinary folder syncs; a missing one is an error naming it.
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/sync_folder";
  std::filesystem::create_directories(dir);
  EXPECT_NO_THROW(SyncFolder(dir));
  try {
    SyncFolder(dir + "/absent");
    ADD_FAILURE() << "no error for a missing folder";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), dir + "/absent: cannot open folder to fsync it: " + std::strerror(ENOENT));
  }
}

// Waits until more than `begun` of the writers' test pauses have begun
// (internal::PausesBegunForTesting), for 10 s at most; whether they had.
bool PauseBegunAfter(int64_t begun) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (internal::PausesBegunForTesting() <= begun) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A tensor changed by another thread while its file is being written (a
// save of live CPU tensors during training) aborts the save: the file
// would not match its own checksum. The last good file stays in place.
TEST(Safetensors, ATensorChangedDuringTheWriteAbortsTheSave) {
  const std::string dir = TmpDir("st_changed");
  const std::string path = dir + "/c.safetensors";
  std::vector<float> a(16, 1.0f), b(16, 2.0f);
  WriteSafetensorsFile(path, {{"a", StDtype::kF32, {16}, a.data(), 64}, {"b", StDtype::kF32, {16}, b.data(), 64}});
  const std::string good = ReadAll(path);
  // Pieces: length, header, a, b; `b` changes during the first pause,
  // which then ends (it would last 30 s), and so do the others.
  const int64_t begun = internal::PausesBegunForTesting();
  internal::SetWritePausePerPiece(std::chrono::seconds(30));
  bool changed_in_pause = false;
  std::thread trainer([&] {
    changed_in_pause = PauseBegunAfter(begun);
    std::atomic_ref<float>(b[3]).store(7.0f);
    internal::SetWritePausePerPiece(std::chrono::milliseconds(0));
  });
  const std::string error = ErrorOf([&] {
    WriteSafetensorsFile(path, {{"a", StDtype::kF32, {16}, a.data(), 64}, {"b", StDtype::kF32, {16}, b.data(), 64}});
  });
  trainer.join();
  EXPECT_TRUE(changed_in_pause) << "the write was not seen in its first pause within 10 s";
  EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("tensor `b` changed while it was being saved")));
  EXPECT_EQ(ReadAll(path), good);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// internal::SetWritePausePerPiece (tests of deadlines around long writes
// rely on it): each piece waits the pause, a stop asked for during the
// pause spares the piece that was about to be written, and setting the
// pause to zero ends the pause under way.
TEST(Safetensors, WritePausePerPieceSlowsEveryPieceAndAStopDuringItSparesThePiece) {
  const std::string dir = TmpDir("st_pause");
  const std::string path = dir + "/c.safetensors";
  const std::string data(kStopCheckBytes + 1, 'x');  // two pieces
  WriteAll(path, "old");
  const int64_t begun_before = internal::PausesBegunForTesting();
  internal::SetWritePausePerPiece(std::chrono::milliseconds(100));
  {
    AtomicFileWriter out(path);
    const auto start = std::chrono::steady_clock::now();
    out.Write(data.data(), data.size());
    EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
    EXPECT_EQ(internal::PausesBegunForTesting() - begun_before, 2) << "not one pause per piece";
    // Both pieces written; not committed (its fsync of 64 MiB is no part
    // of this), so the temporary goes with the writer.
    struct stat st{};
    ASSERT_EQ(::stat(out.temp_path().c_str(), &st), 0);
    EXPECT_EQ(st.st_size, static_cast<off_t>(data.size()));
  }
  // The stop comes once the writer is seen in the first pause, which then
  // ends long before its 30 s.
  const int64_t begun = internal::PausesBegunForTesting();
  internal::SetWritePausePerPiece(std::chrono::seconds(30));
  std::atomic<bool> stop{false};
  std::string error;
  {
    AtomicFileWriter out(path, &stop);
    bool stopped_in_pause = false;
    std::thread stopper([&] {
      stopped_in_pause = PauseBegunAfter(begun);
      stop = true;
      internal::SetWritePausePerPiece(std::chrono::milliseconds(0));
    });
    const auto start = std::chrono::steady_clock::now();
    error = ErrorOf([&] { out.Write(data.data(), data.size()); });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15))
        << "the pause did not end when it was set to zero";
    stopper.join();
    EXPECT_TRUE(stopped_in_pause) << "the write was not seen in its first pause within 10 s";
    struct stat st{};
    ASSERT_EQ(::stat(out.temp_path().c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 0) << "a piece was written after the stop";
  }
  EXPECT_THAT(error, HasSubstr("the write was stopped"));
  EXPECT_EQ(ReadAll(path), "old");
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// The number of the system call thread `tid` of this process is in, or -1
// when it is in none (or /proc cannot tell).
long SyscallOf(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/syscall");
  long nr = -1;
  if (!(in >> nr)) return -1;
  return nr;
}

// Before, Commit looked at the stop flag only before its fsync, where most
// of the disk work happens: a deadline passing during the fsync still let
// the new file replace the old one after every rank had been told the save
// failed. Here the flag is raised while the committing thread is inside
// fsync (seen in /proc), as a deadline passing there would.
TEST(Safetensors, StopRaisedDuringTheCommitsFsyncLeavesTheOldFileAndNoTemporary) {
  const std::string dir = TmpDir("st_stop_fsync");
  const std::string path = dir + "/c.safetensors";
  const float a = 1;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  const std::string before = ReadAll(path);
  // Enough fresh data that the fsync takes long enough to be seen. On a
  // loaded host the watcher may miss a short fsync: then the commit went
  // through, the old file is put back and the write tried again.
  const std::string data(size_t{64} << 20, 'x');
  std::atomic<bool> seen{false};
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  std::string error;
  for (int attempt = 0; attempt < 5 && !seen.load(); ++attempt) {
    if (attempt > 0) WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
    std::atomic<bool> stop{false};
    std::atomic<bool> done{false};
    AtomicFileWriter out(path, &stop);
    out.Write(data.data(), data.size());
    std::thread watcher([&] {
      while (!done.load()) {
        if (SyscallOf(tid) == SYS_fsync) {
          seen = true;
          stop = true;
          return;
        }
      }
    });
    error = ErrorOf([&] { out.Commit(); });
    done = true;
    watcher.join();
  }
  ASSERT_TRUE(seen.load()) << "the committing thread was never seen inside fsync";
  EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("the write was stopped")));
  // Not EXPECT_EQ: a failure would print the whole new file.
  const std::string after = ReadAll(path);
  EXPECT_TRUE(after == before) << "the old file was replaced by " << after.size() << " new bytes";
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// Before, the file was opened before its type was looked at: opening a
// FIFO for reading waits for a writer, so the read hung without end.
TEST(Safetensors, ReadingAFifoFailsAtOnceNamingThePath) {
  const std::string dir = TmpDir("st_fifo");
  const std::string path = dir + "/c.safetensors";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  auto read = std::async(std::launch::async, [&] { return ErrorOf([&] { SafetensorsFile::Read(path); }); });
  if (read.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    // Open the write end so that the hung open returns and the test ends.
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) ::close(fd);
    read.wait();
    FAIL() << "reading the FIFO " << path << " was still blocked after 5 s";
  }
  EXPECT_THAT(read.get(), AllOf(HasSubstr(path), HasSubstr("not a regular file but a FIFO")));
}

// Before, a short read of the length field gave strerror of whatever errno
// held from earlier. A sysfs attribute is a regular file whose size (4096)
// is more than it holds ("0-1\n"): a file shorter than its size said.
TEST(Safetensors, ShortReadOfTheLengthFieldSaysTheFileGotShorter) {
  const std::string path = "/sys/devices/system/cpu/online";
  struct stat st{};
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path << ": " << std::strerror(errno);
  ASSERT_TRUE(S_ISREG(st.st_mode) && st.st_size >= 8) << path << " is not a sysfs attribute of size >= 8";
  errno = EAGAIN;  // a stale value the old message reported
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadBytes(path); }),
              AllOf(HasSubstr(path), HasSubstr("cannot read its first 8 bytes: the file got shorter while being read")));
}

// Read keeps the data region in memory of its own (mapped for huge pages
// over 2 MiB): every tensor's bytes are there, at odd sizes of every
// element size, and a copy of the file keeps them once the original is
// gone.
TEST(Safetensors, ReadGivesEveryTensorsBytesAndCopiesKeepThem) {
  const std::string path = TmpDir("st_read_region") + "/c.safetensors";
  struct Spec {
    const char* name;
    StDtype dtype;
    int64_t count;
  };
  const std::vector<Spec> specs = {{"u8", StDtype::kU8, 3},
                                   {"bf16", StDtype::kBF16, 5},
                                   {"big", StDtype::kF32, (int64_t{3} << 20) / 4 + 1},
                                   {"f64", StDtype::kF64, 7}};
  std::vector<std::string> bytes;
  std::vector<TensorView> views;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::string b(static_cast<size_t>(specs[i].count * StDtypeSize(specs[i].dtype)), '\0');
    for (size_t k = 0; k < b.size(); ++k) b[k] = static_cast<char>((k * 131 + i * 17) >> 3);
    bytes.push_back(std::move(b));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    views.push_back({specs[i].name, specs[i].dtype, {specs[i].count}, bytes[i].data(), bytes[i].size()});
  }
  WriteSafetensorsFile(path, views);
  std::optional<SafetensorsFile> copy;
  {
    const SafetensorsFile f = SafetensorsFile::Read(path);
    copy = f;
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorEntry* e = copy->Find(specs[i].name);
    ASSERT_NE(e, nullptr) << specs[i].name;
    ASSERT_EQ(e->nbytes, bytes[i].size()) << specs[i].name;
    EXPECT_EQ(std::memcmp(copy->Data(*e), bytes[i].data(), e->nbytes), 0) << specs[i].name;
  }
}

// A file cut short while ReadBytes (and so Read) reads its data: the error
// names the tensor whose bytes ran out, as ReadInto's does. Before, it gave
// only the byte counts.
TEST(Safetensors, AFileCutShortDuringReadBytesNamesTheTensor) {
  const std::string path = TmpDir("st_cut_read") + "/c.safetensors";
  const std::vector<float> a(16, 1.0f), b(1000, 2.0f);
  WriteSafetensorsFile(path, {{"first", StDtype::kF32, {16}, a.data(), 64},
                              {"second.weight", StDtype::kF32, {1000}, b.data(), 4000}});
  const uint64_t data_start = ReadAll(path).size() - 64 - 4000;
  for (const bool parse : {false, true}) {
    SCOPED_TRACE(parse ? "Read" : "ReadBytes");
    WriteSafetensorsFile(path, {{"first", StDtype::kF32, {16}, a.data(), 64},
                                {"second.weight", StDtype::kF32, {1000}, b.data(), 4000}});
    int truncated = -1;
    internal::SetReadPieceHookForTesting([&](uint64_t got) {
      if (got == data_start) truncated = ::truncate(path.c_str(), static_cast<off_t>(data_start + 64 + 100));
    });
    const std::string error = ErrorOf([&] {
      if (parse) {
        (void)SafetensorsFile::Read(path);
      } else {
        (void)SafetensorsFile::ReadBytes(path);
      }
    });
    internal::SetReadPieceHookForTesting({});
    ASSERT_EQ(truncated, 0) << "the read never reached the data region";
    EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("in tensor `second.weight`"),
                             HasSubstr("the file got shorter while read")));
  }
}

// A file written in place while read (a `cp` over a checkpoint while a
// rank loads it) may give bytes of two versions: the read now fails saying
// so. Before, a file without a data checksum (one from Python) loaded the
// mix silently, and one with a checksum was called corrupt. The file's
// modification time is set back first, so that the write in the middle of
// the read changes it whatever the clock's resolution.
TEST(Safetensors, AFileWrittenToWhileReadIsRefused) {
  const std::string path = TmpDir("st_written_while_read") + "/w.safetensors";
  const std::string data(4096, 'a');
  std::string header = R"({"w":{"dtype":"U8","shape":[4096],"data_offsets":[0,4096]}})";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  std::string plain(8, '\0');
  for (int i = 0; i < 8; ++i) plain[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  plain += header + data;
  const std::string checked = SerializeSafetensors({{"w", StDtype::kU8, {4096}, data.data(), data.size()}});
  for (const bool with_crc : {false, true}) {
    for (const bool parse : {false, true}) {
      SCOPED_TRACE(std::string(with_crc ? "with" : "without") + " a checksum, " + (parse ? "Read" : "ReadBytes"));
      const std::string& bytes = with_crc ? checked : plain;
      WriteAll(path, bytes);
      const timespec past[2] = {{946684800, 0}, {946684800, 0}};  // 2000-01-01
      ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), past, 0), 0) << std::strerror(errno);
      const uint64_t data_start = bytes.size() - data.size();
      int wrote = -1;
      internal::SetReadPieceHookForTesting([&](uint64_t got) {
        if (got != data_start) return;
        const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
        if (fd < 0) return;
        const std::string other(data.size(), 'b');
        wrote = ::pwrite(fd, other.data(), other.size(), static_cast<off_t>(data_start)) ==
                        static_cast<ssize_t>(other.size())
                    ? 0
                    : 1;
        ::close(fd);
      });
      const std::string error = ErrorOf([&] {
        if (parse) {
          (void)SafetensorsFile::Read(path);
        } else {
          (void)SafetensorsFile::ReadBytes(path);
        }
      });
      internal::SetReadPieceHookForTesting({});
      ASSERT_EQ(wrote, 0) << "the read never reached the data region, or the write failed";
      EXPECT_THAT(error, HasSubstr(path + ": the file was written to while read (its modification time changed)"));
      // Read again once the writer is done: the new bytes, whole (where no
      // checksum of the old ones refuses them).
      if (parse && !with_crc) {
        const SafetensorsFile file = SafetensorsFile::Read(path);
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.Data(file.tensors()[0])), data.size()),
                  std::string(data.size(), 'b'));
      }
    }
  }
}

// Read calls this process has made so far (syscr of /proc/self/io).
uint64_t ReadCallsSoFar() {
  std::ifstream in("/proc/self/io");
  std::string key;
  uint64_t value = 0;
  while (in >> key >> value) {
    if (key == "syscr:") return value;
  }
  ADD_FAILURE() << "/proc/self/io gives no syscr: line";
  return 0;
}

// A file of many small tensors for ReadInto: 3 * IOV_MAX + 5 of one float
// each, `t<i>` holding i. Fills `data_start` with where its data begins.
std::string ManySmallTensors(const std::string& tag, size_t* count, uint64_t* data_start) {
  const long iov_max = ::sysconf(_SC_IOV_MAX);
  EXPECT_GT(iov_max, 0);
  *count = 3 * static_cast<size_t>(std::max(iov_max, 16L)) + 5;
  std::vector<float> values(*count);
  std::vector<TensorView> views(*count);
  for (size_t i = 0; i < *count; ++i) {
    values[i] = static_cast<float>(i);
    views[i] = TensorView{"t" + std::to_string(i), StDtype::kF32, {1}, &values[i], 4};
  }
  const std::string path = TmpDir(tag) + "/many.safetensors";
  WriteSafetensorsFile(path, views);
  *data_start = ReadAll(path).size() - 4 * *count;
  return path;
}

// Where ManySmallTensors' tensor i goes: every third float of `apart`
// (the two between left alone), but every seventh tensor has none (read
// for the checksum only), and tensors [100, 200) go one after another to
// `touching`, which one buffer of the read covers.
std::vector<void*> ScatteredPlaces(size_t count, std::vector<float>& apart, std::vector<float>& touching) {
  apart.assign(3 * count, -1.0f);
  touching.assign(100, -1.0f);
  std::vector<void*> where(count);
  for (size_t i = 0; i < count; ++i) {
    if (i >= 100 && i < 200) where[i] = &touching[i - 100];
    else if (i % 7 != 0) where[i] = &apart[3 * i];
  }
  return where;
}

// ReadInto reads neighbouring tensors with one preadv of up to IOV_MAX
// buffers: three IOV_MAX's worth of tensors take a few read calls, not one
// each (3,081 before). Every tensor lands where the placer said and nothing
// beside it is written, across the batches' boundaries.
TEST(Safetensors, ReadIntoReadsNeighbouringTensorsInFewCallsAcrossIovMaxBatches) {
  size_t count = 0;
  uint64_t data_start = 0;
  const std::string path = ManySmallTensors("st_batched", &count, &data_start);
  std::vector<float> apart, touching;
  const std::vector<void*> where = ScatteredPlaces(count, apart, touching);
  const uint64_t calls_before = ReadCallsSoFar();
  const SafetensorsFile file = SafetensorsFile::ReadInto(path, [&](const SafetensorsFile& f) {
    EXPECT_EQ(f.tensors().size(), count);
    return where;
  });
  const uint64_t calls = ReadCallsSoFar() - calls_before;
  EXPECT_LT(calls, count / 10) << "read calls for " << count << " tensors";
  EXPECT_FALSE(file.data_checksum().empty());
  for (size_t i = 0; i < count; ++i) {
    SCOPED_TRACE("tensor t" + std::to_string(i));
    ASSERT_EQ(file.tensors()[i].name, "t" + std::to_string(i));
    const bool apart_has_it = where[i] != nullptr && (i < 100 || i >= 200);
    EXPECT_EQ(apart[3 * i], apart_has_it ? static_cast<float>(i) : -1.0f);
    EXPECT_EQ(apart[3 * i + 1], -1.0f);
    EXPECT_EQ(apart[3 * i + 2], -1.0f);
  }
  for (size_t i = 100; i < 200; ++i) EXPECT_EQ(touching[i - 100], static_cast<float>(i));
}

// A file cut short while ReadInto reads a batch, in the middle of a tensor
// that is neither the batch's first nor its last: the error names that
// tensor and the position where the bytes ran out.
TEST(Safetensors, AFileCutShortInTheMiddleOfAReadIntoBatchNamesTheTensor) {
  size_t count = 0;
  uint64_t data_start = 0;
  const std::string path = ManySmallTensors("st_batch_cut", &count, &data_start);
  const uint64_t size = data_start + 4 * count;
  const size_t cut_in = count / 2;  // in the second batch
  const uint64_t cut_at = data_start + 4 * cut_in + 2;
  std::vector<float> apart, touching;
  const std::vector<void*> where = ScatteredPlaces(count, apart, touching);
  int truncated = -1;
  internal::SetReadPieceHookForTesting([&](uint64_t got) {
    if (got == data_start) truncated = ::truncate(path.c_str(), static_cast<off_t>(cut_at));
  });
  const std::string error =
      ErrorOf([&] { SafetensorsFile::ReadInto(path, [&](const SafetensorsFile&) { return where; }); });
  internal::SetReadPieceHookForTesting({});
  ASSERT_EQ(truncated, 0) << "the read never reached the data region";
  EXPECT_THAT(error, HasSubstr(path + ": read " + std::to_string(cut_at) + " of " + std::to_string(size) +
                               " bytes, in tensor `t" + std::to_string(cut_in) +
                               "`: the file got shorter while read"));
  // The tensors before the cut were read.
  EXPECT_EQ(apart[3 * (cut_in - 1)], static_cast<float>(cut_in - 1));
}

// ReadInto with destinations that do not follow the file: tensors of
// several dtypes (so the header lists them in another order than the data
// region holds them), some not asked for between ones that are, one placed
// right after a tensor two places before it in the file (the one between
// not asked for), and one placed right before the tensor it follows in the
// file. Each lands whole where it was sent (the bytes Read gives), nothing
// around it is written, and a file cut inside a tensor not asked for names
// that tensor.
TEST(Safetensors, ReadIntoPlacesTensorsOutOfFileOrderAndSkipsThoseNotAskedFor) {
  const std::string path = TmpDir("st_out_of_order") + "/o.safetensors";
  const int64_t i64[2] = {-3, 1ll << 40};
  const double f64[1] = {2.5};
  const float f32a[3] = {1, 2, 3}, f32c[1] = {9};
  const uint16_t f16[5] = {0x3c00, 0x4000, 0x4200, 0x4400, 0x4500};
  const uint8_t u8[7] = {1, 2, 3, 4, 5, 6, 7};
  WriteSafetensorsFile(path, {{"a", StDtype::kF32, {3}, f32a, 12},
                              {"h", StDtype::kF16, {5}, f16, 10},
                              {"b", StDtype::kI64, {2}, i64, 16},
                              {"c", StDtype::kF32, {1}, f32c, 4},
                              {"s", StDtype::kU8, {7}, u8, 7},
                              {"d", StDtype::kF64, {1}, f64, 8}});
  const SafetensorsFile whole = SafetensorsFile::Read(path);
  std::vector<std::string> file_order;
  for (const TensorEntry& e : whole.tensors()) file_order.push_back(e.name);
  ASSERT_EQ(file_order, (std::vector<std::string>{"b", "d", "a", "c", "h", "s"}));

  // Not asked for: d and c. a begins where b ends (d, between them in the
  // file, skipped); s, after h in the file, ends where h begins.
  constexpr uint8_t kUntouched = 0xab;
  std::vector<uint8_t> buffer(64, kUntouched);
  const std::map<std::string, size_t> at = {{"b", 1}, {"a", 17}, {"s", 33}, {"h", 40}};
  const auto place = [&](const SafetensorsFile& f) {
    std::vector<void*> where(f.tensors().size(), nullptr);
    for (size_t i = 0; i < where.size(); ++i) {
      const auto it = at.find(f.tensors()[i].name);
      if (it != at.end()) where[i] = buffer.data() + it->second;
    }
    return where;
  };
  const SafetensorsFile file = SafetensorsFile::ReadInto(path, place);
  EXPECT_EQ(file.data_checksum(), whole.data_checksum());
  EXPECT_FALSE(file.data_checksum().empty());
  std::vector<bool> written(buffer.size(), false);
  for (const auto& [name, offset] : at) {
    SCOPED_TRACE("tensor " + name);
    const TensorEntry* e = whole.Find(name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(std::memcmp(buffer.data() + offset, whole.Data(*e), e->nbytes), 0);
    for (size_t k = offset; k < offset + e->nbytes; ++k) written[k] = true;
  }
  for (size_t k = 0; k < buffer.size(); ++k) {
    if (!written[k]) {
      EXPECT_EQ(buffer[k], kUntouched) << "byte " << k << " of the buffer";
    }
  }

  // Cut 2 bytes into c, which is read for the checksum only.
  const uint64_t size = ReadAll(path).size();
  const uint64_t data_start = size - whole.tensors().back().offset - whole.tensors().back().nbytes;
  const uint64_t cut_at = data_start + whole.Find("c")->offset + 2;
  int truncated = -1;
  internal::SetReadPieceHookForTesting([&](uint64_t got) {
    if (got == data_start) truncated = ::truncate(path.c_str(), static_cast<off_t>(cut_at));
  });
  const std::string error = ErrorOf([&] { SafetensorsFile::ReadInto(path, place); });
  internal::SetReadPieceHookForTesting({});
  ASSERT_EQ(truncated, 0) << "the read never reached the data region";
  EXPECT_THAT(error, HasSubstr(path + ": read " + std::to_string(cut_at) + " of " + std::to_string(size) +
                               " bytes, in tensor `c`: the file got shorter while read"));
}

TEST(Safetensors, StoppedReadSaysHowFarItGot) {
  const std::string dir = TmpDir("st_stop_read");
  const std::string path = dir + "/c.safetensors";
  const float a = 1;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  std::atomic<bool> stop{true};
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadBytes(path, &stop); }),
              AllOf(HasSubstr(path), HasSubstr("the read was stopped after 0 of " +
                                               std::to_string(ReadAll(path).size()) + " bytes")));
  stop = false;
  EXPECT_EQ(SafetensorsFile::Read(path, &stop).tensors().size(), 1u);
}

TEST(Safetensors, UnwritableFolderNamesThePath) {
  const float a = 1;
  EXPECT_THAT(ErrorOf([&] {
                WriteSafetensorsFile("/nonexistent_dir_ddp/x.safetensors", {{"x", StDtype::kF32, {}, &a, 4}});
              }),
              AllOf(HasSubstr("/nonexistent_dir_ddp/x.safetensors"), HasSubstr("No such file")));
}

// The pid of a process that has exited (reaped), and this host's name.
pid_t ExitedPid() {
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  waitpid(gone, nullptr, 0);
  return gone;
}
std::string HostName() {
  char host[256] = {};
  return gethostname(host, sizeof(host) - 1) == 0 ? std::string(host) : std::string();
}

// A writer killed at random points never leaves a file that loads as
// something wrong: the old content or the new one.
TEST(Safetensors, KilledWriterLeavesOldOrNewFile) {
  const std::string dir = TmpDir("st_kill");
  const std::string path = dir + "/c.safetensors";
  std::vector<float> big(1 << 20);
  auto write_gen = [&](float gen) {
    std::fill(big.begin(), big.end(), gen);
    WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1 << 20}, big.data(), big.size() * 4}},
                         {{"gen", std::to_string(static_cast<int>(gen))}});
  };
  write_gen(0);
  std::mt19937 rng(3);
  for (int round = 1; round <= 12; ++round) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (int g = 1;; ++g) write_gen(static_cast<float>(round * 1000 + g));
    }
    usleep(2000 + rng() % 20000);
    kill(child, SIGKILL);
    int status;
    waitpid(child, &status, 0);
    SafetensorsFile f = SafetensorsFile::Read(path);
    const int gen = std::stoi(f.metadata().at("gen"));
    std::vector<float> got(1 << 20);
    std::memcpy(got.data(), f.Data(f.tensors()[0]), got.size() * 4);
    for (float v : got) ASSERT_EQ(v, static_cast<float>(gen));
  }
  // Temporaries of killed writers stay behind (SIGKILL leaves no chance to
  // clean up), never under the checkpoint's name; the next write removes them.
  for (const std::string& name : FilesIn(dir)) {
    EXPECT_TRUE(name == "c.safetensors" || name.rfind("c.safetensors.tmp.", 0) == 0) << name;
  }
  // One of a process that has exited, one whose pid a live process has
  // (the parent: in a container a dead writer's pid is soon taken again).
  // No writer holds their locks: both go, with the killed writers' ones.
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  waitpid(gone, nullptr, 0);
  WriteAll(path + ".tmp." + std::to_string(gone) + ".3-0123abcd." + HostName(), "x");
  WriteAll(path + ".tmp." + std::to_string(getppid()) + ".0-89abcdef." + HostName(), "x");
  write_gen(1);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// This host's dead writers' temporaries go at once; another host's fresh
// one stays (on a shared folder its pid says nothing here, and only an
// unlocked one idle for an hour goes: atomic_file_test), and
// `c.safetensors.tmp.5` is a target of its own whose temporaries start
// with `c.safetensors.tmp.`.
TEST(Safetensors, ThisHostsDeadWritersTemporariesGoAndAnotherHostsFreshOneStays) {
  const std::string dir = TmpDir("st_hosts");
  const std::string path = dir + "/c.safetensors";
  const std::string host = HostName();
  ASSERT_FALSE(host.empty());
  const std::string dead = std::to_string(ExitedPid());
  const std::vector<std::string> kept = {
      "c.safetensors.tmp." + dead + ".0-0123abcd.some-other-host",  // another host's writer
      "c.safetensors.tmp.5.tmp." + dead + ".0-0123abcd." + host,    // another target's
      "c.safetensors.tmp." + dead + ".x-0123abcd." + host,          // not a temporary's name
  };
  for (const std::string& name : kept) WriteAll(dir + "/" + name, "x");
  WriteAll(path + ".tmp." + dead + ".7-0123abcd." + host, "x");  // this host's, writer gone
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  std::vector<std::string> left = FilesIn(dir);
  std::sort(left.begin(), left.end());
  std::vector<std::string> expected = kept;
  expected.push_back("c.safetensors");
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(left, expected);
}

// Only names of the exact form a writer gives its temporaries are taken
// for a dead writer's: a user's own `c.safetensors.tmp.<digits>.<digits>`
// (a copy kept by hand, another tool's temporary), the same with a host,
// a nonce of another length, or a FIFO of a temporary's name, are not this
// code's and stay. Before, the first two were removed (unlocked, so taken
// for a killed writer's) by the next write of c.safetensors.
TEST(Safetensors, AUsersFileNamedLikeATemporaryIsKept) {
  const std::string dir = TmpDir("st_users_tmp");
  const std::string path = dir + "/c.safetensors";
  const std::string host = HostName();
  ASSERT_FALSE(host.empty());
  const std::string dead = std::to_string(ExitedPid());
  const std::vector<std::string> users = {
      "c.safetensors.tmp." + dead + ".1",
      "c.safetensors.tmp.20261205.1",
      "c.safetensors.tmp." + dead + ".1." + host,
      "c.safetensors.tmp." + dead + ".1-0123a." + host,
      "c.safetensors.tmp." + dead + ".1-0123abcd",
  };
  for (const std::string& name : users) WriteAll(dir + "/" + name, "the user's own");
  const std::string fifo = "c.safetensors.tmp." + dead + ".2-0123abcd." + host;
  ASSERT_EQ(mkfifo((dir + "/" + fifo).c_str(), 0644), 0);
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  std::vector<std::string> left = FilesIn(dir);
  std::sort(left.begin(), left.end());
  std::vector<std::string> expected = users;
  expected.push_back(fifo);
  expected.push_back("c.safetensors");
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(left, expected);
  for (const std::string& name : users) EXPECT_EQ(ReadAll(dir + "/" + name), "the user's own") << name;
}

// A temporary whose pid names no process here but whose writer holds its
// lock (a live writer in another PID namespace: a container with this host
// name writing to the same folder) is kept; once the lock is gone, removed.
TEST(Safetensors, ALockedTemporaryOfAnUnknownPidIsKept) {
  const std::string dir = TmpDir("st_pidns");
  const std::string path = dir + "/c.safetensors";
  const std::string host = HostName();
  ASSERT_FALSE(host.empty());
  const std::string other = "c.safetensors.tmp." + std::to_string(ExitedPid()) + ".0-0123abcd." + host;
  WriteAll(dir + "/" + other, "x");
  const int fd = open((dir + "/" + other).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  std::vector<std::string> left = FilesIn(dir);
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"c.safetensors", other}));
  close(fd);
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// A writer holds its temporary's lock while it writes, so that another
// namespace's cleanup can tell it lives.
TEST(Safetensors, AWriterLocksItsTemporary) {
  const std::string dir = TmpDir("st_lock");
  AtomicFileWriter writer(dir + "/c.bin");
  std::vector<std::string> files = FilesIn(dir);
  ASSERT_EQ(files.size(), 1u);
  const int fd = open((dir + "/" + files[0]).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_NE(flock(fd, LOCK_EX | LOCK_NB), 0);
  EXPECT_EQ(errno, EWOULDBLOCK);
  close(fd);
}

// Before, a temporary went only when its pid named no process here: in a
// container restarted with the same small pids and host name, a dead
// writer's temporary named with this process's pid or a live stranger's
// stayed forever (each as large as a checkpoint). Now the lock decides.
// Kept: a temporary locked through another open file (another writer
// thread's here, whose lock conflicts as another process's would), this
// process's own writer's open one.
TEST(Safetensors, AnUnlockedTemporaryGoesWhateverItsPidAndALockedOneStays) {
  const std::string dir = TmpDir("st_pid_reused");
  const std::string path = dir + "/c.safetensors";
  const std::string host = HostName();
  ASSERT_FALSE(host.empty());
  const std::string mine = "c.safetensors.tmp." + std::to_string(getpid()) + ".900-0123abcd." + host;
  const std::string strangers = "c.safetensors.tmp." + std::to_string(getppid()) + ".901-0123abcd." + host;
  const std::string locked = "c.safetensors.tmp." + std::to_string(getpid()) + ".902-0123abcd." + host;
  const std::string with_nonce =
      "c.safetensors.tmp." + std::to_string(getppid()) + ".903-0123456789abcdef." + host;
  for (const std::string& name : {mine, strangers, locked, with_nonce}) WriteAll(dir + "/" + name, "x");
  const int fd = open((dir + "/" + locked).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  AtomicFileWriter open_writer(path);
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  std::vector<std::string> left = FilesIn(dir);
  std::sort(left.begin(), left.end());
  std::vector<std::string> expected = {"c.safetensors", locked,
                                       open_writer.temp_path().substr(dir.size() + 1)};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(left, expected);
  close(fd);
}

// A temporary name already taken (here by a live writer of "another
// container": same pid, counter and host name, its file locked) is passed
// over for the next name; before, the clash failed the write. Names also
// carry a per-process random nonce after the counter.
TEST(Safetensors, ATakenTemporaryNameIsPassedOverForTheNext) {
  const std::string dir = TmpDir("st_name_clash");
  const std::string path = dir + "/c.safetensors";
  std::string first;
  {
    AtomicFileWriter probe(path);
    first = probe.temp_path().substr(dir.size() + 1);
  }
  const std::string prefix = "c.safetensors.tmp." + std::to_string(getpid()) + ".";
  ASSERT_EQ(first.rfind(prefix, 0), 0u) << first;
  // The counter, then what follows it up to the host.
  const std::string rest = first.substr(prefix.size());
  size_t digits = 0;
  while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) ++digits;
  ASSERT_GT(digits, 0u) << first;
  const std::string next =
      prefix + std::to_string(std::stoull(rest.substr(0, digits)) + 1) + rest.substr(digits);
  const size_t host_dot = rest.find('.');
  ASSERT_NE(host_dot, std::string::npos) << first;
  const std::string after_counter = rest.substr(digits, host_dot - digits);
  EXPECT_EQ(after_counter.size(), 9u) << "no nonce in " << first;
  EXPECT_EQ(after_counter.find_first_not_of("0123456789abcdef", 1), std::string::npos) << first;
  WriteAll(dir + "/" + next, "another writer's");
  const int fd = open((dir + "/" + next).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  float value = 3;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}});
  EXPECT_EQ(SafetensorsFile::Read(path).tensors().size(), 1u);
  EXPECT_EQ(ReadAll(dir + "/" + next), "another writer's");
  close(fd);
}

// Before, a target that is a folder was found out only by the rename, after
// the whole file had been written beside it.
// A target whose own name is legal but too long to take the temporary
// file's suffix (pid, counter, nonce, host) within NAME_MAX is written all
// the same: its temporaries carry the name's first 100 bytes and its
// CRC-32 instead. Before, creating the temporary failed with
// ENAMETOOLONG, so such a file could not be saved at all. The cleanup
// still finds the temporaries of such a target's dead writers.
TEST(Safetensors, ATargetNameTooLongForTheTemporarySuffixIsWritten) {
  const std::string dir = TmpDir("st_long_target");
  const std::string base = std::string(240, 'n') + ".safetensors";  // 252 bytes
  const std::string path = dir + "/" + base;
  const float a = 1, b = 2;
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &a, 4}});
  const SafetensorsFile f = SafetensorsFile::Read(path);
  float v;
  std::memcpy(&v, f.Data(f.tensors()[0]), 4);
  EXPECT_EQ(v, 1.0f);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{base});
  std::string temp;
  {
    AtomicFileWriter out(path);
    temp = out.temp_path().substr(dir.size() + 1);
    EXPECT_LE(temp.size(), 255u);
    EXPECT_EQ(temp.rfind(std::string(100, 'n') + ".", 0), 0u) << temp;
  }
  // A temporary of the same form that no writer holds (its writer died):
  // the next write removes it.
  const std::string prefix = temp.substr(0, temp.find(".tmp.") + 5);
  const std::string stale = prefix + std::to_string(ExitedPid()) + ".4-0123abcd." + HostName();
  WriteAll(dir + "/" + stale, "x");
  WriteSafetensorsFile(path, {{"x", StDtype::kF32, {}, &b, 4}});
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{base});
}

TEST(Safetensors, TargetThatIsAFolderIsRefusedBeforeAnythingIsWritten) {
  const std::string dir = TmpDir("st_target_folder");
  const std::string path = dir + "/c.safetensors";
  ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  EXPECT_THAT(ErrorOf([&] { AtomicFileWriter out(path); }), AllOf(HasSubstr(path), HasSubstr("it is a folder")));
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.safetensors"});
}

// A stop through an OrderedStop is seen by a Commit that has not yet made
// its last check (the file stays as it was), and a Commit past that check
// (here paused before its rename) makes Stop() say so: its file goes in.
TEST(Safetensors, OrderedStopSaysWhetherTheRenameHadBegun) {
  const std::string dir = TmpDir("st_ordered_stop");
  const std::string path = dir + "/c.bin";
  WriteAll(path, "old");
  {
    std::atomic<bool> stop{false};
    OrderedStop ordered(stop);
    AtomicFileWriter out(path, &stop);
    out.Write("new", 3);
    EXPECT_FALSE(ordered.Stop());
    EXPECT_THAT(ErrorOf([&] { out.Commit(); }), HasSubstr("the write was stopped"));
  }
  EXPECT_EQ(ReadAll(path), "old");
  {
    std::atomic<bool> stop{false};
    OrderedStop ordered(stop);
    AtomicFileWriter out(path, &stop);
    out.Write("new", 3);
    // The stop comes once the committing thread is seen in this pause
    // (past its last check), which is then ended: before the rename.
    const int64_t begun = internal::PausesBegunForTesting();
    internal::SetPauseBeforeRenameForTesting(std::chrono::seconds(30));
    std::string error;
    std::thread commit([&] {
      try {
        out.Commit();
      } catch (const CheckpointError& e) {
        error = e.what();
      }
    });
    EXPECT_TRUE(PauseBegunAfter(begun))
        << "the committing thread was not seen in its pause before the rename within 10 s";
    EXPECT_TRUE(ordered.Stop());
    internal::SetPauseBeforeRenameForTesting(std::chrono::milliseconds(0));
    commit.join();
    EXPECT_EQ(error, "");
  }
  EXPECT_EQ(ReadAll(path), "new");
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"c.bin"});
}

TEST(Safetensors, ReplacedFileKeepsItsPermissions) {
  const std::string path = TmpDir("st_mode") + "/c.safetensors";
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  value = 2;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  struct stat st{};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

// Only the permission bits of the replaced file are carried over: before,
// its setuid, setgid and sticky bits went to the new contents too (a
// checkpoint written over a setuid file became a setuid file).
TEST(Safetensors, ReplacedFileKeepsOnlyItsPermissionBits) {
  const std::string path = TmpDir("st_mode_special") + "/c.safetensors";
  float value = 1;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  ASSERT_EQ(chmod(path.c_str(), 07750), 0);
  struct stat st{};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  ASSERT_NE(st.st_mode & 07000, 0u) << "this filesystem keeps no special mode bits";
  value = 2;
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &value, 4}}, {});
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0750u);
}

// The temporary replacing a private file is private from the moment it
// exists: another user who opened it while it was still 0644 (before, the
// mode was narrowed only after the creation) could read the whole new
// checkpoint through that descriptor, whatever the mode became. A new file
// still gets 0644 less the umask.
TEST(Safetensors, TheTemporaryOfAPrivateFileIsNeverReadableByOthers) {
  const std::string dir = TmpDir("st_mode_at_creation");
  const std::string path = dir + "/c.bin";
  std::vector<mode_t> created;
  internal::SetTemporaryCreatedHookForTesting([&](const std::string& temp) {
    struct stat st{};
    created.push_back(::stat(temp.c_str(), &st) == 0 ? st.st_mode & 07777 : 07777);
  });
  const mode_t umask_was = ::umask(022);
  {
    AtomicFileWriter out(path);
    out.Write("new", 3);
    out.Commit();
  }
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  {
    AtomicFileWriter out(path);
    out.Write("newer", 5);
    out.Commit();
  }
  ::umask(umask_was);
  internal::SetTemporaryCreatedHookForTesting({});
  EXPECT_EQ(created, (std::vector<mode_t>{0644, 0600}));
  struct stat st{};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(ReadAll(path), "newer");
}

// --- rejected input ---

std::string Build(const std::string& header_json, const std::string& data) {
  std::string s(8, '\0');
  const uint64_t n = header_json.size();
  std::memcpy(s.data(), &n, 8);
  return s + header_json + data;
}

std::string ParseError(const std::string& bytes) {
  return ErrorOf([&] { SafetensorsFile::Parse(bytes, "bad.safetensors"); });
}

// Before, the JSON parser kept the last of two equal keys silently: a
// second entry for a tensor replaced the first, and a second __metadata__
// without the checksum turned the data's CRC check off.
TEST(SafetensorsErrors, KeyTwiceInAnObjectIsRefused) {
  const std::string x = R"("x":{"dtype":"F32","shape":[],"data_offsets":[0,4]})";
  const std::string data(4, '\0');
  EXPECT_THAT(ParseError(Build("{" + x + "," + x + "}", data)),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("key `x` appears twice")));
  EXPECT_THAT(ParseError(Build(R"({"__metadata__":{"ddp.data_crc32":"00000000"},"__metadata__":{},)" + x + "}", data)),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("key `__metadata__` appears twice")));
  EXPECT_THAT(ParseError(Build(R"({"__metadata__":{"k":"a","k":"b"},)" + x + "}", data)),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("key `k` appears twice in `__metadata__`")));
  EXPECT_THAT(ParseError(Build(R"({"x":{"dtype":"F32","dtype":"F32","shape":[],"data_offsets":[0,4]}})", data)),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("key `dtype` appears twice in `x`")));
  // The same keys in different objects are fine.
  EXPECT_NO_THROW(SafetensorsFile::Parse(Build(R"({"__metadata__":{"x":"v"},)" + x + "}", data), "ok"));
}

// A header of 60,000 entries (a large model with its optimizer state, or a
// hostile file) is parsed in time linear in its size. Before, the check for
// repeated keys went through a JSON parse callback, which made the parser
// search the whole top-level object each time an entry ended: 10 s for
// 40,000 entries here, 40 s for 50,000, and hours for the 2 million that a
// 100 MB header holds.
TEST(SafetensorsErrors, HeaderOfManyTensorsParsesInLinearTime) {
  auto entries = [](int n) {
    std::string text;
    for (int i = 0; i < n; ++i) {
      text += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})";
    }
    return text;
  };
  constexpr int kTensors = 60000;
  const std::string header = "{" + entries(kTensors) + "}";
  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile f = SafetensorsFile::Parse(Build(header, ""), "many.safetensors");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(f.tensors().size(), static_cast<size_t>(kTensors));
  EXPECT_LT(seconds, 5.0);  // about 0.2 s in a debug build
  // Repeated keys are still found, wherever they are.
  EXPECT_THAT(ParseError(Build("{" + entries(1000) + R"(,"t7":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", "")),
              HasSubstr("key `t7` appears twice"));
}

// JSON's -0 is a negative number (Python's reader refuses it as an
// offset or a dimension too), but the parser hands it over as the integer
// 0: the message said "is 0, expected a non-negative integer".
TEST(SafetensorsErrors, MinusZeroIsQuotedAsWritten) {
  const std::string data(4, '\0');
  EXPECT_THAT(ParseError(Build(R"({"x":{"dtype":"F32","shape":[],"data_offsets":[-0,4]}})", data)),
              HasSubstr("data_offsets[0] is -0, expected a non-negative integer"));
  EXPECT_THAT(ParseError(Build(R"({"x":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})", "")),
              HasSubstr("shape [-0] must hold non-negative integers"));
}

TEST(SafetensorsErrors, TruncatedAtEveryOffset) {
  const Sample s = EveryDtype();
  const std::string bytes = SerializeSafetensors(s.Views(), {{"k", "v"}});
  for (size_t len = 0; len < bytes.size(); ++len) {
    const std::string msg = ParseError(bytes.substr(0, len));
    ASSERT_THAT(msg, HasSubstr("bad.safetensors: invalid safetensors file")) << len;
  }
  EXPECT_THAT(ParseError(bytes.substr(0, 5)), HasSubstr("shorter than the 8-byte header length"));
  EXPECT_THAT(ParseError(bytes.substr(0, 100)), HasSubstr("truncated file?"));
  EXPECT_THAT(ParseError(bytes.substr(0, bytes.size() - 1)), HasSubstr("extend past the"));
}

TEST(SafetensorsErrors, ExtraBytesAfterTheData) {
  const float a = 1;
  EXPECT_THAT(ParseError(SerializeSafetensors({{"x", StDtype::kF32, {}, &a, 4}}) + "zz"),
              HasSubstr("bytes [4, 6) of the data region belong to no tensor"));
}

// Every single-byte change of the header is either rejected or changes only
// a name, a metadata string or the shape of an empty tensor (which the
// checkpoint layer's key and shape checks catch); never a dtype, a non-empty
// shape or an offset.
TEST(SafetensorsErrors, FlippedHeaderBytes) {
  const Sample s = EveryDtype();
  const std::string bytes = SerializeSafetensors(s.Views(), {{"epoch", "1"}});
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  // Only a flip in the header checksum's own key can hide it (a file
  // without one is read unchecked, as files from elsewhere are).
  const std::string mark = std::string("\"") + kHeaderChecksumKey + "\":";
  const size_t mark_at = 8 + bytes.find(mark, 8);
  ASSERT_NE(mark_at, std::string::npos + 8);
  int rejected = 0, renamed = 0;
  for (uint64_t pos = 0; pos < 8 + n; ++pos) {
    for (uint8_t mask : {0x01, 0x20, 0x80}) {
      std::string bad = bytes;
      bad[pos] = static_cast<char>(bad[pos] ^ mask);
      try {
        SafetensorsFile f = SafetensorsFile::Parse(bad, "bad.safetensors");
        ++renamed;
        ASSERT_TRUE(pos >= mark_at - 8 && pos < mark_at - 8 + mark.size())
            << "a flip at " << pos << ", outside the header checksum's key, was read";
        ASSERT_EQ(f.tensors().size(), s.names.size());
        bool name_or_meta_changed = f.metadata() != Metadata{{"epoch", "1"}};
        for (size_t i = 0; i < s.names.size(); ++i) {
          const TensorEntry& e = f.tensors()[f.header_order()[i]];  // header order = written order
          name_or_meta_changed |= e.name != s.names[i];
          ASSERT_EQ(e.dtype, s.dtypes[i]) << pos;
          // A tensor with no elements keeps 0 bytes under another shape
          // with a 0 in it; the checkpoint layer's shape check catches that.
          if (e.nbytes != 0) {
            ASSERT_EQ(e.shape, s.shapes[i]) << pos;
          }
          name_or_meta_changed |= e.shape != s.shapes[i];
          ASSERT_EQ(std::memcmp(f.Data(e), s.bytes[i].data(), e.nbytes), 0) << pos;
        }
        ASSERT_TRUE(name_or_meta_changed) << "flip at " << pos << " changed nothing";
      } catch (const CheckpointError& e) {
        ++rejected;
        ASSERT_THAT(e.what(), HasSubstr("bad.safetensors")) << pos;
      }
    }
  }
  EXPECT_GT(rejected, renamed);
  EXPECT_LE(renamed, static_cast<int>(3 * mark.size()));
}

// What a checksum mismatch adds for a file another tool rewrote keeping the
// metadata (Python's safetensors with metadata=f.metadata()).
const auto kSaysKeysToDrop = AllOf(
    HasSubstr("no longer matches the checksum recorded when the file was written"),
    HasSubstr("edited by another tool that kept the metadata"),
    HasSubstr("must drop the ddp.data_crc32 and ddp.header_crc32 keys"));

// The header checksum is checked before the header is read: a changed
// digit in a shape or an offset (which may still parse) is refused as a
// corrupt header, or one another tool edited.
TEST(SafetensorsErrors, ChangedDigitInTheHeaderFailsItsChecksum) {
  const float w[4] = {1, 2, 3, 4};
  std::string bytes = SerializeSafetensors({{"w", StDtype::kF32, {4}, w, sizeof(w)}}, {{"step", "1000"}});
  const size_t at = bytes.find("\"1000\"");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 4] = '9';  // "1009": still valid JSON, the data CRC still matches
  EXPECT_THAT(ParseError(bytes),
              AllOf(HasSubstr("header checksum is"), HasSubstr("the header is corrupt"),
                    kSaysKeysToDrop));
  const std::string path = TmpDir("st_header_crc") + "/c.safetensors";
  WriteAll(path, bytes);
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadMetadata(path); }),
              AllOf(HasSubstr(path), HasSubstr("the header is corrupt")));
}

TEST(SafetensorsErrors, FlippedDataBytesFailTheChecksum) {
  const Sample s = EveryDtype();
  const std::string bytes = SerializeSafetensors(s.Views(), {});
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  for (uint64_t pos = 8 + n; pos < bytes.size(); pos += 7) {
    std::string bad = bytes;
    bad[pos] ^= 0x10;
    ASSERT_THAT(ParseError(bad), HasSubstr("checksum")) << pos;
  }
}

TEST(SafetensorsErrors, HeaderLengthLargerThanTheFile) {
  std::string bytes = Build("{}", "");
  bytes[5] = 1;
  EXPECT_THAT(ParseError(bytes), AllOf(HasSubstr("header length"), HasSubstr("exceeds the 2 bytes")));
}

TEST(SafetensorsErrors, HeaderIsNotJson) {
  EXPECT_THAT(ParseError(Build("{\"a\":", "")), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseError(Build("[1,2]", "")), HasSubstr("does not start with '{'"));
  EXPECT_THAT(ParseError(Build("{\"a\":[[[[1]]]]}", "")), HasSubstr("nests deeper"));
  EXPECT_THAT(ParseError(Build("{\"a\":\"\xff\"}", "")), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseError(Build(std::string("{}\0{\"x\":1}", 10), "")),
              HasSubstr("NUL byte at offset 2"));
}

// Every dtype name Python's safetensors writes with whole bytes per
// element parses, with its element size checking the offsets; before, one
// such tensor made the whole file unreadable.
TEST(SafetensorsErrors, EveryWholeByteDtypeOfPythonParses) {
  const std::vector<std::pair<std::string, int>> dtypes = {
      {"BOOL", 1}, {"I8", 1},      {"I16", 2},     {"U16", 2},     {"U32", 4},
      {"U64", 8},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"C64", 8}};
  std::string header = "{";
  std::string data;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const auto& [name, size] = dtypes[i];
    const size_t begin = data.size();
    for (int b = 0; b < 3 * size; ++b) data.push_back(static_cast<char>(i * 16 + b));
    header += std::string(i ? "," : "") + "\"t." + name + "\":{\"dtype\":\"" + name +
              "\",\"shape\":[3],\"data_offsets\":[" + std::to_string(begin) + "," +
              std::to_string(data.size()) + "]}";
  }
  header += "}";
  const SafetensorsFile f = SafetensorsFile::Parse(Build(header, data), "py.safetensors");
  ASSERT_EQ(f.tensors().size(), dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const auto& [name, size] = dtypes[i];
    const TensorEntry* e = f.Find("t." + name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(StDtypeName(e->dtype), name);
    EXPECT_EQ(StDtypeSize(e->dtype), size);
    EXPECT_EQ(StDtypeFromName(name), e->dtype);
    EXPECT_EQ(e->shape, std::vector<int64_t>{3});
    EXPECT_EQ(e->nbytes, static_cast<uint64_t>(3 * size));
    EXPECT_EQ(static_cast<char>(*f.Data(*e)), static_cast<char>(i * 16));
  }
  // The element size checks the offsets as for any other dtype.
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"U16","shape":[3],"data_offsets":[0,5]}})", "abcde")),
              AllOf(HasSubstr("`w`: dtype U16 and shape [3] need 6 bytes")));
}

// Text from a hostile or corrupt header is cut in messages: a key of 1 MB
// given twice, a metadata value that is a long array, a long JSON token.
TEST(SafetensorsErrors, MessagesStayShortWhateverTheHeaderHolds) {
  const std::string key(1 << 20, 'k');
  const std::string x = "\"" + key + "\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}";
  const std::string data(4, '\0');
  const std::string twice = ParseError(Build("{" + x + "," + x + "}", data));
  EXPECT_THAT(twice, AllOf(HasSubstr("bad.safetensors"), HasSubstr("appears twice")));
  EXPECT_LT(twice.size(), 1024u);
  std::string list = "[";
  for (int i = 0; i < 100000; ++i) list += (i ? ",1" : "1");
  list += "]";
  const std::string metadata =
      ParseError(Build("{\"__metadata__\":{\"" + key + "\":" + list + "}," + x + "}", data));
  EXPECT_THAT(metadata, AllOf(HasSubstr("bad.safetensors"), HasSubstr("expected a string")));
  EXPECT_LT(metadata.size(), 1024u);
  const std::string token = ParseError(Build("{\"" + key + "\" " + x + "}", data));
  EXPECT_THAT(token, AllOf(HasSubstr("bad.safetensors"), HasSubstr("not valid JSON")));
  EXPECT_LT(token.size(), 1024u);
}

// Bytes by which the peak resident size grew while `run` ran, as a forked
// child measures it (so that nothing this process did before counts), or -1
// when `run` returned false or threw. In the child, blocks of 1 MiB or more
// are mapped and unmapped on their own: after the earlier tests' large
// frees, malloc's threshold for that had risen to 32 MiB, and the blocks a
// growing string left behind on the heap stayed resident (the same read
// measured 4.3 times its string after the whole suite, 3.2 alone).
int64_t PeakGrowthOf(const std::function<bool()>& run) {
  malloc_trim(0);  // pages of freed blocks, which the child would reuse unseen
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
    int64_t result = -1;
    try {
      rusage before, after;
      ::getrusage(RUSAGE_SELF, &before);
      const bool right = run();
      ::getrusage(RUSAGE_SELF, &after);
      if (right) result = (static_cast<int64_t>(after.ru_maxrss) - before.ru_maxrss) * 1024;  // KiB
    } catch (...) {
    }
    const ssize_t w = ::write(fds[1], &result, sizeof(result));
    ::_exit(w == sizeof(result) ? 0 : 1);
  }
  ::close(fds[1]);
  int64_t result = -1;
  if (pid < 0 || ::read(fds[0], &result, sizeof(result)) != sizeof(result)) result = -1;
  ::close(fds[0]);
  if (pid > 0) ::waitpid(pid, nullptr, 0);
  return result;
}

// One string of 45 MiB in a header (the format allows 100 MB): a metadata
// value, a metadata key, a tensor's name, or a shape's element, which is
// refused. The header
// text and nlohmann's lexer (the token and its raw characters) hold it
// three times while it is read, which no change here avoids; the reader's
// own copies came on top: the metadata value copied out of the token, the
// key copied twice (the map's and the last key's), the shape's element
// copied and then written out whole for a message that quotes 200 bytes of
// it. The lexer's buffers grow by doubling, the old and new block held at
// once, so the peak also depends on where they last doubled: up to one
// more time the string when that was just before its end. 45 MiB is past
// their last doubling (at 32 MiB), as 90 MiB is (at 64). Measured: 3.35
// times the string in each case; before, 4.2 for a metadata value, 5.2 for
// a key, 6.2 for the refused shape (and for a value of 90 MiB, the test
// run alone: 361 MiB before, 284 now); 4.0 for a tensor's name, which the
// reader copied for its check of names given twice.
TEST(SafetensorsErrors, AHugeStringInTheHeaderTakesAboutThreeTimesItsSizeToRead) {
  constexpr size_t kString = size_t{45} << 20;
  const std::string dir = TmpDir("st_huge_string");
  const std::string entry = R"("w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  // A file whose header is `before`, the string, `after`, and then `data`.
  const auto write = [&](const std::string& name, const std::string& before, const std::string& after,
                         const std::string& data) {
    const std::string path = dir + "/" + name + ".safetensors";
    std::string header = before;
    header.append(kString, 'v');
    header += after;
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string length(8, '\0');
    for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    std::ofstream(path, std::ios::binary) << length << header << data;
    return path;
  };
  const std::string value = write("value", R"({"__metadata__":{"k":")", R"("},)" + entry + "}", "ab");
  const std::string key = write("key", R"({"__metadata__":{")", R"(":"v"},)" + entry + "}", "ab");
  const std::string shape = write("shape", R"({"w":{"dtype":"U8","shape":[")", R"("],"data_offsets":[0,0]}})", "");
  const std::string name = write("name", R"({")", R"(":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ab");
  // Whether `m` holds one entry, of a key and a value of these sizes.
  const auto holds = [&](const Metadata& m, size_t key_size, size_t value_size) {
    return m.size() == 1 && m.begin()->first.size() == key_size && m.begin()->second.size() == value_size;
  };
  struct Case {
    const char* what;
    int64_t growth;
  };
  const Case cases[] = {
      {"Read, a metadata value",
       PeakGrowthOf([&] { return holds(SafetensorsFile::Read(value).metadata(), 1, kString); })},
      {"ReadMetadata, a metadata value",
       PeakGrowthOf([&] { return holds(SafetensorsFile::ReadMetadata(value), 1, kString); })},
      {"Read, a metadata key",
       PeakGrowthOf([&] { return holds(SafetensorsFile::Read(key).metadata(), kString, 1); })},
      {"Read, a tensor's name", PeakGrowthOf([&] {
         const SafetensorsFile f = SafetensorsFile::Read(name);
         return f.tensors().size() == 1 && f.tensors()[0].name.size() == kString && f.metadata().empty();
       })},
      {"ReadMetadata, a tensor's name", PeakGrowthOf([&] { return SafetensorsFile::ReadMetadata(name).empty(); })},
      {"Read, a shape's element (refused)", PeakGrowthOf([&] {
         try {
           (void)SafetensorsFile::Read(shape);
         } catch (const CheckpointError& e) {
           const std::string what = e.what();
           return what.find("tensor `w`: shape [\"vvv") != std::string::npos &&
                  what.find("(" + std::to_string(kString + 4) + " bytes) must hold non-negative integers") !=
                      std::string::npos;
         }
         return false;
       })},
  };
  for (const std::string& path : {value, key, shape, name}) ::unlink(path.c_str());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_GE(c.growth, 0) << "the child's read failed or gave something else";
    std::printf("%s: peak resident growth %.1f MiB for a string of %.1f MiB\n", c.what, c.growth / 1048576.0,
                kString / 1048576.0);
    // Between the 3.35 times now and the 4.2 of the least case before.
    EXPECT_LT(static_cast<double>(c.growth), 3.75 * kString);
  }
}

// A shape is header text too: one of a thousand dimensions whose size does
// not match its offsets made a 3 KB message before (a 3 MB one for a
// million dimensions, which are now refused by the limit below).
TEST(SafetensorsErrors, AShapeOfAThousandDimensionsIsCutInMessages) {
  std::string shape = "[";
  for (int i = 0; i < 1000; ++i) shape += i ? ",1" : "1";
  shape += "]";
  const std::string msg = ParseError(
      Build("{\"w\":{\"dtype\":\"F32\",\"shape\":" + shape + ",\"data_offsets\":[0,8]}}", std::string(8, '\0')));
  EXPECT_THAT(msg, AllOf(HasSubstr("bad.safetensors"), HasSubstr("`w`: dtype F32 and shape [1, 1, 1"),
                         HasSubstr(", ... (1000 dimensions)] need 4 bytes, data_offsets [0, 8] hold 8")));
  EXPECT_LT(msg.size(), 1024u);
}

// A header is read without building a JSON value of it (HeaderReader), but
// what it holds is still kept: a metadata entry costs about 100 bytes
// besides its text, a dimension 8 bytes for the 2 of "1,". Before these
// limits, a 50 MB header of short metadata entries took 1.1 GB to read and
// one of a 25-million-dimension shape 1.1 GB. Both are refused now, naming
// the file and the limit, and the writers refuse what readers would.
TEST(SafetensorsErrors, MoreMetadataEntriesOrDimensionsThanTheLimitsAreRefused) {
  const std::string dir = TmpDir("limits");
  std::string metadata = "{";
  for (size_t i = 0; i <= kMaxMetadataEntries; ++i) metadata += (i ? ",\"" : "\"") + std::to_string(i) + "\":\"\"";
  metadata += "}";
  const std::string path = dir + "/many_metadata.safetensors";
  WriteAll(path, Build("{\"__metadata__\":" + metadata + "}", ""));
  const std::string limit = std::to_string(kMaxMetadataEntries);
  for (const std::string& error : {ErrorOf([&] { SafetensorsFile::ReadMetadata(path); }),
                                   ErrorOf([&] { SafetensorsFile::Read(path); })}) {
    EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("__metadata__ has more than " + limit + " entries")));
  }
  Metadata at_limit;
  for (size_t i = 0; i + 2 < kMaxMetadataEntries; ++i) at_limit[std::to_string(i)] = "";
  const std::string full = dir + "/full_metadata.safetensors";
  WriteSafetensorsFile(full, {}, at_limit);
  EXPECT_EQ(SafetensorsFile::ReadMetadata(full), at_limit);
  at_limit["one more"] = "";
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(dir + "/over.safetensors", {}, at_limit); }),
              AllOf(HasSubstr("over.safetensors"), HasSubstr(std::to_string(kMaxMetadataEntries - 2))));

  std::string shape = "[0";
  for (size_t i = 1; i <= kMaxShapeDims; ++i) shape += ",1";
  shape += "]";
  EXPECT_THAT(ParseError(Build("{\"w\":{\"dtype\":\"F32\",\"shape\":" + shape + ",\"data_offsets\":[0,0]}}", "")),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("tensor `w`: shape has " + std::to_string(kMaxShapeDims + 1) +
                                                             " dimensions, more than the " +
                                                             std::to_string(kMaxShapeDims))));
  std::vector<int64_t> dims(kMaxShapeDims, 1);
  dims[0] = 0;
  const std::string widest = dir + "/widest.safetensors";
  WriteSafetensorsFile(widest, {{"w", StDtype::kF32, dims, nullptr, 0}});
  EXPECT_EQ(SafetensorsFile::Read(widest).tensors().at(0).shape, dims);
  dims.push_back(1);
  EXPECT_THAT(ErrorOf([&] { WriteSafetensorsFile(dir + "/wider.safetensors", {{"w", StDtype::kF32, dims, nullptr, 0}}); }),
              AllOf(HasSubstr("wider.safetensors"), HasSubstr("`w` has " + std::to_string(kMaxShapeDims + 1) +
                                                               " dimensions")));
}

// Keys that no reader reads (an entry's own besides dtype, shape and
// data_offsets) are not checked for repeats, as Python's reader does not:
// whichever one is kept makes no difference. The keys it reads still are.
TEST(SafetensorsErrors, AnIgnoredKeyOfAnEntryMayRepeat) {
  const SafetensorsFile f = SafetensorsFile::Parse(
      Build(R"({"w":{"dtype":"U8","note":1,"shape":[2],"note":[2],"data_offsets":[0,2]}})", "ab"), "ok");
  EXPECT_EQ(f.tensors().at(0).nbytes, 2u);
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"U8","shape":[2],"shape":[2],"data_offsets":[0,2]}})", "ab")),
              HasSubstr("key `shape` appears twice in `w`"));
}

// A name may hold any character escaped in the JSON header. Before, a NUL
// in one ended the message at what() right after the name's first bytes,
// so it no longer said what was wrong; a newline split it in two.
TEST(SafetensorsErrors, ControlBytesInANameAreEscapedInMessages) {
  const std::string msg = ParseError(
      Build(R"({"w\u0000x\n\u001b":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0')));
  EXPECT_THAT(msg,
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("tensor `w\\x00x\\x0a\\x1b`: dtype F32 and shape [1]"),
                    HasSubstr("need 4 bytes, data_offsets [0, 8] hold 8")));
  EXPECT_EQ(NameForMessage(std::string("a\x7f\tb", 4)), "a\\x7f\\x09b");
  // Bytes of UTF-8 characters are not control bytes.
  EXPECT_EQ(NameForMessage("caf\xc3\xa9"), "caf\xc3\xa9");
}

TEST(SafetensorsErrors, EntryFields) {
  EXPECT_THAT(ParseError(Build(R"({"w":3})", "")), HasSubstr("`w`: entry is number"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", "abcd")),
              HasSubstr("`w`: missing dtype"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F8_E3M4","shape":[1],"data_offsets":[0,1]}})", "a")),
              AllOf(HasSubstr("`w`: dtype \"F8_E3M4\" is not supported"), HasSubstr("BOOL")));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", "abcd")),
              HasSubstr("missing shape"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd")),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "abcd")),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[1]}})", "abcd")),
              HasSubstr("missing data_offsets"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "abcd")),
              HasSubstr("missing data_offsets"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}})", "abcd")),
              HasSubstr("data_offsets[1] is -4"));
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "abcd")),
              HasSubstr("end before they begin"));
}

TEST(SafetensorsErrors, SizeDoesNotMatchDtypeAndShape) {
  EXPECT_THAT(ParseError(Build(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,4]}})", "abcd")),
              AllOf(HasSubstr("`w`: dtype F64 and shape [1] need 8 bytes"), HasSubstr("hold 4")));
  EXPECT_THAT(ParseError(Build(
                  R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", "abcd")),
              HasSubstr("more than 2^62"));
  // Empty, yet no tensor of that shape could be made: refused here, naming
  // the tensor, instead of by Empty() at load without a name.
  EXPECT_THAT(ParseError(Build(
                  R"({"w":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})", "")),
              AllOf(HasSubstr("`w`"), HasSubstr("more than 2^62")));
}

TEST(SafetensorsErrors, OverlappingOffsets) {
  EXPECT_THAT(ParseError(Build(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                               R"("b":{"dtype":"U8","shape":[3],"data_offsets":[2,5]}})",
                               "abcde")),
              AllOf(HasSubstr("`b`: data_offsets [2, 5] overlap tensor `a` [0, 3]")));
}

// Offsets that overlap, or leave a gap, in a file with bytes after its last
// tensor: the readers of a path report the first problem in data-region
// order, as Parse does for the same bytes. Before, they checked the file's
// end first and blamed the trailing bytes alone, naming no tensor.
TEST(SafetensorsErrors, OverlapOrGapBeforeTrailingBytesIsReportedAsParseReportsIt) {
  const std::string dir = TmpDir("st_layout");
  const auto nowhere = [](const SafetensorsFile& f) { return std::vector<void*>(f.tensors().size(), nullptr); };
  const std::pair<std::string, std::string> cases[] = {
      {R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
       "tensor `b`: data_offsets [2, 6] overlap tensor `a` [0, 4]"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
       "bytes [2, 4) of the data region belong to no tensor"},
  };
  for (const auto& [header, says] : cases) {
    SCOPED_TRACE(says);
    const std::string bytes = Build(header, "abcdefgh");
    const std::string path = dir + "/l.safetensors";
    WriteAll(path, bytes);
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Parse(bytes, path); }), AllOf(HasSubstr(path), HasSubstr(says)));
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }), AllOf(HasSubstr(path), HasSubstr(says)));
    EXPECT_THAT(ErrorOf([&] { SafetensorsFile::ReadInto(path, nowhere); }), AllOf(HasSubstr(path), HasSubstr(says)));
  }
}

TEST(SafetensorsErrors, OffsetsOutOfRange) {
  EXPECT_THAT(ParseError(Build(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                               R"("b":{"dtype":"U8","shape":[3],"data_offsets":[3,6]}})",
                               "abcde")),
              HasSubstr("`b`: data_offsets [3, 6] extend past the 5-byte data region"));
  EXPECT_THAT(ParseError(Build(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,0]}})", "")),
              HasSubstr("end before they begin"));
}

TEST(SafetensorsErrors, GapInTheDataRegion) {
  EXPECT_THAT(ParseError(Build(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "abc")),
              HasSubstr("bytes [0, 1) of the data region belong to no tensor"));
}

TEST(SafetensorsErrors, MetadataMustBeStrings) {
  EXPECT_THAT(ParseError(Build(R"({"__metadata__":{"epoch":3}})", "")),
              HasSubstr("value for `epoch` is 3, expected a string"));
  EXPECT_THAT(ParseError(Build(R"({"__metadata__":[1]})", "")), HasSubstr("not an object"));
}

// `"__metadata__": null` is a file without metadata, as Python's and Rust's
// safetensors read it (an optional map); writers that do not leave the key
// out put it there. Before, such a file was refused ("__metadata__ is not an
// object of strings") by Parse, Read, ReadMetadata and LoadTensors.
TEST(Safetensors, NullMetadataIsNoMetadata) {
  const std::string bytes =
      Build(R"({"__metadata__":null,"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0'));
  const SafetensorsFile parsed = SafetensorsFile::Parse(bytes, "null_metadata");
  EXPECT_TRUE(parsed.metadata().empty());
  ASSERT_EQ(parsed.tensors().size(), 1u);
  EXPECT_EQ(parsed.tensors()[0].name, "w");
  const std::string path = TmpDir("st_null_metadata") + "/n.safetensors";
  WriteAll(path, bytes);
  EXPECT_EQ(SafetensorsFile::Read(path).tensors().size(), 1u);
  EXPECT_TRUE(SafetensorsFile::ReadMetadata(path).empty());
  float got[2] = {1, 1};
  const SafetensorsFile placed =
      SafetensorsFile::ReadInto(path, [&](const SafetensorsFile&) { return std::vector<void*>{got}; });
  EXPECT_TRUE(placed.metadata().empty());
  EXPECT_EQ(got[0], 0.0f);
}

TEST(SafetensorsErrors, ChecksumMismatchIsReported) {
  EXPECT_THAT(ParseError(Build(R"({"__metadata__":{"ddp.data_crc32":"00000000"},)"
                               R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "a")),
              AllOf(HasSubstr("checksum is e8b7be43"), HasSubstr("the header says 00000000"),
                    HasSubstr("the tensor data is corrupt"), kSaysKeysToDrop));
}

TEST(SafetensorsErrors, WriterRejectsReservedNames) {
  const float a = 1;
  EXPECT_THROW(SerializeSafetensors({{"__metadata__", StDtype::kF32, {}, &a, 4}}), std::invalid_argument);
  EXPECT_THROW(SerializeSafetensors({}, {{kChecksumKey, "x"}}), std::invalid_argument);
  EXPECT_THROW(SerializeSafetensors({}, {{kHeaderChecksumKey, "x"}}), std::invalid_argument);
  EXPECT_THROW(SerializeSafetensors({{"x", StDtype::kF32, {-1}, &a, 4}}), std::invalid_argument);
  EXPECT_THROW(SerializeSafetensors({{"\xff", StDtype::kF32, {}, &a, 4}}), std::invalid_argument);
}

// A large file that is no safetensors file (a dataset archive given as the
// checkpoint): refused from its first 8 bytes, before its size is allocated.
// The file is sparse: 64 GiB on paper, a few bytes on disk.
TEST(SafetensorsErrors, LargeFileThatIsNotSafetensorsIsRefusedBeforeItIsRead) {
  const std::string path = TmpDir("st_large") + "/archive.tar";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fputs("ustar\x7f\x7f\x7f", f);  // 8 bytes: a length of about 9e18
    std::fclose(f);
    ASSERT_EQ(::truncate(path.c_str(), int64_t{64} << 30), 0);
  }
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }),
              AllOf(HasSubstr(path), HasSubstr("header length"),
                    HasSubstr("exceeds the 68719476728 bytes after the length field"),
                    HasSubstr("not a safetensors file")));
  // A plausible length past the header limit: refused as well.
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    const uint64_t n = kMaxHeaderBytes + 1;
    std::fwrite(&n, 8, 1, f);
    std::fclose(f);
  }
  EXPECT_THAT(ErrorOf([&] { SafetensorsFile::Read(path); }),
              AllOf(HasSubstr("header length 100000001 exceeds the limit")));
  std::remove(path.c_str());
}

TEST(SafetensorsErrors, MissingFile) {
  EXPECT_THAT(ErrorOf([] { SafetensorsFile::Read("/nonexistent_ddp.safetensors"); }),
              AllOf(HasSubstr("/nonexistent_ddp.safetensors"), HasSubstr("No such file")));
}

// The errno nested in a CheckpointError (std::rethrow_if_nested), -1 when
// nothing is nested, -2 when something other than a std::system_error is.
int NestedErrno(const CheckpointError& e) {
  try {
    std::rethrow_if_nested(e);
  } catch (const std::system_error& s) {
    return s.code().value();
  } catch (...) {
    return -2;
  }
  return -1;
}

// A read the host fails carries its errno nested, as CheckpointError says:
// a missing file ENOENT, no memory for the data region ENOMEM (which came
// with nothing nested, unlike the same failure of ReadBytes), and a
// malformed file nothing. The memory failure is made in a child whose
// address space is limited, for a file whose 2 GiB data region is a hole.
TEST(SafetensorsErrors, AHostFailureCarriesItsErrnoAndABadFileNone) {
  try {
    SafetensorsFile::Read("/nonexistent_ddp.safetensors");
    ADD_FAILURE() << "a missing file was read";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(NestedErrno(e), ENOENT) << e.what();
  }
  const std::string dir = TmpDir("st_host_errno");
  const std::string bad = dir + "/bad.safetensors";
  WriteAll(bad, std::string("\x02\0\0\0\0\0\0\0{}", 10) + "x");
  try {
    SafetensorsFile::Read(bad);
    ADD_FAILURE() << "a malformed file was read";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(NestedErrno(e), -1) << e.what();
  }
  const uint64_t region = uint64_t{2} << 30;
  std::string header = R"({"w":{"dtype":"U8","shape":[)" + std::to_string(region) + R"(],"data_offsets":[0,)" +
                       std::to_string(region) + "]}}";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  const std::string big = dir + "/big.safetensors";
  WriteAll(big, head + header);
  ASSERT_EQ(::truncate(big.c_str(), static_cast<off_t>(8 + header.size() + region)), 0) << std::strerror(errno);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The address space now plus 256 MiB: far from the region's 2 GiB.
    std::ifstream status("/proc/self/status");
    uint64_t vm_kib = 0;
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmSize:", 0) == 0) vm_kib = std::stoull(line.substr(7));
    }
    if (vm_kib == 0) _exit(20);
    const rlimit limit{(vm_kib << 10) + (uint64_t{256} << 20), (vm_kib << 10) + (uint64_t{256} << 20)};
    if (::setrlimit(RLIMIT_AS, &limit) != 0) _exit(21);
    try {
      SafetensorsFile::Read(big);
      _exit(22);
    } catch (const CheckpointError& e) {
      if (std::string(e.what()).find("cannot hold its data region of " + std::to_string(region)) ==
          std::string::npos) {
        _exit(23);
      }
      _exit(NestedErrno(e) == ENOMEM ? 0 : 24);
    } catch (...) {
      _exit(25);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  // 22: read in spite of the limit; 23: another error; 24: no ENOMEM nested.
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::remove(big.c_str());
}

}  // namespace
}  // namespace ddp::nn::io
