#include "nn/io/checkpoint.h"
#include "nn/io/testing/io_test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "nn/tensor/testing/host_as_device.h"

namespace ddp::nn::io {
namespace {

using test_util::ErrorOf;
using test_util::TmpPath;
using ::testing::AllOf;
using ::testing::HasSubstr;

Tensor RandomBytes(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = Empty(shape, {.dtype = dtype});
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.Contiguous().data_ptr(), b.Contiguous().data_ptr(), a.nbytes()) == 0;
}

// A safetensors file's first 8 bytes: the length of `header`, little-endian.
std::string HeaderLength(const std::string& header) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes;
}

// A file from Python holding a dtype nn::Tensor lacks (BOOL here) is
// valid: loading it as tensors is refused naming that tensor and its
// dtype, and its other tensors stay readable by name.
TEST(Checkpoint, ATensorOfADtypeTensorsLackIsRefusedNamedAndTheRestStaysReadable) {
  const std::string path = TmpPath("bool.safetensors");
  const std::string header =
      R"({"mask":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]},)"
      R"("w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  std::string bytes = HeaderLength(header);
  const float w[2] = {1.5f, -2.0f};
  bytes += header + std::string("\1\0\1\1", 4) + std::string(reinterpret_cast<const char*>(w), 8);
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("tensor `mask` has dtype BOOL")));
  const SafetensorsFile file = SafetensorsFile::Read(path);
  ASSERT_EQ(file.tensors().size(), 2u);
  const TensorEntry* e = file.Find("w");
  ASSERT_NE(e, nullptr);
  float got[2];
  std::memcpy(got, file.Data(*e), sizeof(got));
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -2.0f);
  EXPECT_EQ(file.Find("mask")->dtype, StDtype::kBool);
  std::remove(path.c_str());
}

// Of several tensors of dtypes nn::Tensor lacks, the one named is the first
// the header lists (the order they were saved and load in), not the first
// in the data region, which the writers order by element size. Before, the
// U16 tensor, first in the data, was named.
TEST(Checkpoint, OfSeveralTensorsOfDtypesTensorsLackTheFirstSavedIsNamed) {
  const std::string path = TmpPath("two_bad.safetensors");
  const std::string header =
      R"({"z_mask":{"dtype":"BOOL","shape":[4],"data_offsets":[4,8]},)"
      R"("y_half":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})";
  std::string bytes = HeaderLength(header);
  bytes += header + std::string("\1\0\2\0\1\0\1\1", 8);
  std::ofstream(path, std::ios::binary) << bytes;
  ASSERT_EQ(SafetensorsFile::Read(path).tensors()[0].name, "y_half");  // first in the data
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("tensor `z_mask` has dtype BOOL")));
  EXPECT_THAT(ErrorOf([&] { LoadTensorsFromBytes(SafetensorsFile::ReadBytes(path), path); }),
              AllOf(HasSubstr(path), HasSubstr("tensor `z_mask` has dtype BOOL")));
  std::remove(path.c_str());
}

TEST(Checkpoint, TensorsRoundTripBitExactForEveryDtype) {
  std::mt19937_64 rng(7);
  NamedTensors in;
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt64, DType::kInt32, DType::kUInt8}) {
    in.emplace_back(std::string("w.") + std::string(DTypeName(d)), RandomBytes({4, 3, 2}, d, rng));
    in.emplace_back(std::string("s.") + std::string(DTypeName(d)), RandomBytes({}, d, rng));
  }
  in.emplace_back("empty", Empty({0, 3}));
  const std::string path = TmpPath("all.safetensors");
  SaveTensors(path, in, {{"k", "v"}});
  LoadedTensors out = LoadTensors(path);
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);
    EXPECT_TRUE(SameBytes(out.tensors[i].second, in[i].second)) << in[i].first;
    EXPECT_TRUE(out.tensors[i].second.device().is_cpu());
  }
  EXPECT_EQ(out.metadata, (Metadata{{"k", "v"}}));
}

TEST(Checkpoint, StridedTensorsAndParametersAreSavedByValue) {
  Tensor m = FromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor t = m.Transpose(0, 1);  // [3, 2], not contiguous
  Tensor p = FromVector({0.5, -0.25}, {2});
  p.set_requires_grad(true);
  const std::string path = TmpPath("strided.safetensors");
  SaveTensors(path, {{"t", t}, {"p", p}});
  LoadedTensors out = LoadTensors(path);
  EXPECT_EQ(out.tensors[0].second.shape(), (Shape{3, 2}));
  EXPECT_EQ(out.tensors[0].second.ToVector<float>(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(out.tensors[1].second.ToVector<float>(), (std::vector<float>{0.5f, -0.25f}));
  EXPECT_FALSE(out.tensors[1].second.requires_grad());
}

TEST(Checkpoint, ModelOptimizerAndMetadataInOneFile) {
  Checkpoint c;
  c.model = {{"fc.weight", FromVector({1, 2, 3, 4}, {2, 2})}, {"fc.bias", FromVector({5, 6}, {2})}};
  c.optimizer = {{"state.fc.weight.momentum_buffer", FromVector({9, 8, 7, 6}, {2, 2})},
                 {"lr", FromVector({0.05}, {}, {.dtype = DType::kFloat64})}};
  c.metadata = {{"epoch", "3"}, {"step", "1200"}};
  const std::string path = TmpPath("ckpt.safetensors");
  SaveCheckpoint(path, c);
  // As a plain file: prefixed names and the marker.
  LoadedTensors raw = LoadTensors(path);
  EXPECT_EQ(raw.tensors[0].first, "model.fc.weight");
  EXPECT_EQ(raw.tensors[2].first, "optim.state.fc.weight.momentum_buffer");
  EXPECT_EQ(raw.metadata.at(kCheckpointMarkerKey), "1");
  Checkpoint back = LoadCheckpoint(path);
  ASSERT_EQ(back.model.size(), 2u);
  ASSERT_EQ(back.optimizer.size(), 2u);
  EXPECT_EQ(back.model[1].first, "fc.bias");
  EXPECT_TRUE(SameBytes(back.model[0].second, c.model[0].second));
  EXPECT_EQ(back.optimizer[0].first, "state.fc.weight.momentum_buffer");
  EXPECT_EQ(back.optimizer[1].second.Item(), 0.05);
  EXPECT_EQ(back.metadata, c.metadata);
  EXPECT_EQ(MetadataInt(back.metadata, "step", path), 1200);
}

TEST(CheckpointErrors, PlainFileIsNotACheckpoint) {
  const std::string path = TmpPath("plain.safetensors");
  SaveTensors(path, {{"w", Zeros({2})}});
  EXPECT_THAT(ErrorOf([&] { LoadCheckpoint(path); }),
              AllOf(HasSubstr(path), HasSubstr("not a checkpoint"), HasSubstr("LoadTensors")));
}

TEST(CheckpointErrors, TensorOutsideBothPrefixes) {
  const std::string path = TmpPath("foreign.safetensors");
  SaveTensors(path, {{"model.w", Zeros({2})}, {"extra", Zeros({1})}}, {{kCheckpointMarkerKey, "1"}});
  EXPECT_THAT(ErrorOf([&] { LoadCheckpoint(path); }),
              AllOf(HasSubstr("`extra` belongs to neither")));
}

TEST(CheckpointErrors, NewerFormatVersion) {
  const std::string path = TmpPath("v2.safetensors");
  SaveTensors(path, {}, {{kCheckpointMarkerKey, "2"}});
  EXPECT_THAT(ErrorOf([&] { LoadCheckpoint(path); }), HasSubstr("version 2 is not supported"));
}

TEST(CheckpointErrors, TruncatedCheckpointNamesTheFile) {
  Checkpoint c;
  c.model = {{"w", Ones({64, 64})}};
  const std::string path = TmpPath("trunc.safetensors");
  SaveCheckpoint(path, c);
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  EXPECT_THAT(ErrorOf([&] { LoadCheckpoint(path); }),
              AllOf(HasSubstr(path), HasSubstr("extend past")));
}

TEST(CheckpointErrors, DeviceWithoutBackend) {
  const std::string path = TmpPath("dev.safetensors");
  SaveTensors(path, {{"w", Zeros({2})}});
  if (HasDeviceBackend(DeviceType::kCUDA)) {
    EXPECT_TRUE(LoadTensors(path, {.device = Device(DeviceType::kCUDA, 0)}).tensors[0].second.device().is_cuda());
  } else {
    EXPECT_ANY_THROW(LoadTensors(path, {.device = Device(DeviceType::kCUDA, 0)}));
  }
}

// The loaders' check of their options, alone, for callers that refuse
// them before work of their own. A device without a backend was a
// std::runtime_error from deep in the tensor library, unlike a device_map
// entry's; now both are std::invalid_argument naming the option.
TEST(CheckpointErrors, LoadOptionsAreCheckedAloneAndRefusedAsInvalidArguments) {
  ASSERT_FALSE(HasDeviceBackend(DeviceType::kCUDA));  // this test links no CUDA library
  EXPECT_NO_THROW(CheckLoadOptions({}));
  EXPECT_NO_THROW(CheckLoadOptions({.device_map = {{"cuda:0", "cpu"}}}));
  EXPECT_THAT([] { CheckLoadOptions({.device_map = {{"cpu", "cuda:0"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  AllOf(HasSubstr("device_map entry \"cpu\" -> \"cuda:0\""), HasSubstr("no backend for cuda:0"))));
  EXPECT_THAT([] { CheckLoadOptions({.device = Device(DeviceType::kCUDA, 0)}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("LoadOptions::device: no backend for cuda:0")));
  // A loader refuses it the same way, before it opens the file.
  EXPECT_THAT([] { LoadTensors(TmpPath("missing.safetensors"), {.device = Device(DeviceType::kCUDA, 0)}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("LoadOptions::device: no backend for cuda:0")));
}

TEST(CheckpointErrors, MetadataIntNamesTheKey) {
  EXPECT_THAT(ErrorOf([] { MetadataInt({}, "epoch", "c.st"); }), HasSubstr("c.st: metadata has no `epoch`"));
  EXPECT_THAT(ErrorOf([] { MetadataInt({{"epoch", "3x"}}, "epoch", "c.st"); }),
              HasSubstr("`epoch` is \"3x\", expected an integer"));
  // A missing key is shown as the other errors show names: control bytes
  // escaped, so a caller's key cannot break the message's line.
  EXPECT_THAT(ErrorOf([] { MetadataInt({}, "ep\noch", "c.st"); }), HasSubstr("metadata has no `ep\\x0aoch`"));
}

// The loaders give the tensors in the order they were saved, whatever
// order their data takes in the file (by element size since the data is
// aligned).
TEST(Checkpoint, TensorsOfMixedDtypesLoadInTheOrderSaved) {
  const std::string path = TmpPath("mixed_order.safetensors");
  const NamedTensors saved = {{"z.small", Zeros({3}, {.dtype = DType::kInt32})},
                              {"a.big", Zeros({1}, {.dtype = DType::kFloat64})},
                              {"m.mid", Zeros({5}, {.dtype = DType::kFloat32})},
                              {"b.big", Zeros({2}, {.dtype = DType::kInt64})}};
  SaveTensors(path, saved);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (const LoadedTensors& loaded : {LoadTensors(path), LoadTensorsFromBytes(bytes, "mem")}) {
    ASSERT_EQ(loaded.tensors.size(), saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      EXPECT_EQ(loaded.tensors[i].first, saved[i].first);
      EXPECT_EQ(loaded.tensors[i].second.dtype(), saved[i].second.dtype()) << saved[i].first;
    }
  }
  std::remove(path.c_str());
}

// Only an optional '-' and digits are an integer: std::stoll took leading
// whitespace and a '+', so " 5" and "+5" read as 5.
TEST(CheckpointErrors, MetadataIntTakesOnlyAMinusSignAndDigits) {
  EXPECT_EQ(MetadataInt({{"step", "-12"}}, "step", "c.st"), -12);
  EXPECT_EQ(MetadataInt({{"step", "9223372036854775807"}}, "step", "c.st"), 9223372036854775807LL);
  for (const std::string bad : {" 5", "+5", "\t5", "5 ", "", "-", "--5", "0x10", "9223372036854775808"}) {
    EXPECT_THAT(ErrorOf([&] { MetadataInt({{"step", bad}}, "step", "c.st"); }),
                AllOf(HasSubstr("c.st: metadata `step` is \""), HasSubstr("expected an integer")))
        << "value \"" << bad << "\"";
  }
}

// A checkpoint as a GPU rank writes it (model and optimizer state saved from
// cuda:0, the learning rate from the CPU), written through the format layer
// since this process has no CUDA backend.
std::string WriteGpuCheckpoint(const std::string& name, const Tensor& w, const Tensor& m) {
  const std::string path = TmpPath(name);
  const double lr = 0.1;
  WriteSafetensorsFile(path,
                       {{"model.w", StDtype::kF32, w.shape(), w.data_ptr(), w.nbytes()},
                        {"optim.state.w.exp_avg", StDtype::kF32, m.shape(), m.data_ptr(), m.nbytes()},
                        {"optim.lr", StDtype::kF64, {}, &lr, sizeof(lr)}},
                       {{kCheckpointMarkerKey, "1"},
                        {"step", "7"},
                        {kDevicesKey, R"({"model.w": "cuda:0", "optim.state.w.exp_avg": "cuda:0"})"}});
  return path;
}

TEST(DeviceMap, SavedOnCuda0LoadsOntoTheCpuThroughTheMap) {
  std::mt19937_64 rng(5);
  const Tensor w = RandomBytes({3, 4}, DType::kFloat32, rng), m = RandomBytes({3, 4}, DType::kFloat32, rng);
  const std::string path = WriteGpuCheckpoint("gpu_ckpt.safetensors", w, m);
  for (const auto& map : {std::map<std::string, std::string>{{"cuda:0", "cpu"}},
                          std::map<std::string, std::string>{{"cuda", "cpu"}, {"cpu", "cpu"}},
                          std::map<std::string, std::string>{}}) {
    const Checkpoint c = LoadCheckpoint(path, {.device_map = map});
    ASSERT_EQ(c.model.size(), 1u);
    ASSERT_EQ(c.optimizer.size(), 2u);
    EXPECT_TRUE(c.model[0].second.device().is_cpu());
    EXPECT_TRUE(SameBytes(c.model[0].second, w));
    EXPECT_TRUE(SameBytes(c.optimizer[0].second, m));
    EXPECT_EQ(c.optimizer[1].second.Item(), 0.1);
    // The device record is consumed; the caller's metadata is as saved.
    EXPECT_EQ(c.metadata, (Metadata{{"step", "7"}}));
  }
}

TEST(DeviceMap, TargetWithoutABackendNamesTheEntryBeforeReading) {
  ASSERT_FALSE(HasDeviceBackend(DeviceType::kCUDA));  // this test links no CUDA library
  std::mt19937_64 rng(6);
  const Tensor w = RandomBytes({2}, DType::kFloat32, rng);
  const std::string path = WriteGpuCheckpoint("gpu_ckpt2.safetensors", w, w);
  EXPECT_THAT([&] { LoadCheckpoint(path, {.device_map = {{"cuda:0", "cuda:1"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  AllOf(HasSubstr("device_map entry \"cuda:0\" -> \"cuda:1\""), HasSubstr("no backend for cuda:1"))));
  // Checked before the file is opened: a missing file is not what is reported.
  EXPECT_THAT([&] { LoadTensors(TmpPath("missing.safetensors"), {.device_map = {{"cpu", "cuda:1"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("no backend for cuda:1")));
}

TEST(DeviceMap, BadEntriesAreNamed) {
  std::mt19937_64 rng(7);
  const Tensor w = RandomBytes({2}, DType::kFloat32, rng);
  const std::string path = WriteGpuCheckpoint("gpu_ckpt3.safetensors", w, w);
  EXPECT_THAT([&] { LoadCheckpoint(path, {.device_map = {{"gpu0", "cpu"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("device_map entry \"gpu0\" -> \"cpu\"")));
  EXPECT_THAT([&] { LoadCheckpoint(path, {.device_map = {{"cuda:0", "tpu:1"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("\"cuda:0\" -> \"tpu:1\"")));
  EXPECT_THAT([&] { LoadCheckpoint(path, {.device_map = {{"cuda", "cpu"}, {"cuda:0", "cpu"}}}); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("cuda:0 is mapped twice")));
}

TEST(DeviceMap, CpuSavesRecordNoDevicesAndTheKeyIsReserved) {
  const std::string path = TmpPath("cpu_only.safetensors");
  SaveTensors(path, {{"w", Ones({2})}}, {{"k", "v"}});
  EXPECT_EQ(SafetensorsFile::Read(path).metadata().count(kDevicesKey), 0u);
  EXPECT_THAT(ErrorOf([&] { SaveTensors(path, {{"w", Ones({2})}}, {{kDevicesKey, "{}"}}); }),
              AllOf(HasSubstr(path), HasSubstr("reserved")));
  // The failed save left the earlier file as it was.
  EXPECT_EQ(LoadTensors(path).metadata, (Metadata{{"k", "v"}}));
}

// Before, a device tensor whose name is not valid UTF-8 made the device
// record's encoding throw nlohmann's error, naming neither file nor tensor.
// Run in a child process: the fake cuda backend must not reach the tests
// above, which count on there being none.
TEST(DeviceMap, DeviceRecordThatCannotBeEncodedNamesTheFileAndTensor) {
  const std::string path = TmpPath("bad_utf8_device.safetensors");
  EXPECT_EXIT(
      {
        nn::testing::RegisterHostAsCuda();  // tensors "on cuda:0" without a GPU
        const Tensor w = Ones({2}).To(Device(DeviceType::kCUDA, 0));
        int code = 1;
        try {
          SaveTensors(path, {{"ok", Ones({1})}, {std::string("w\xff"), w}});
          std::fprintf(stderr, "saved\n");
        } catch (const CheckpointError& e) {
          std::fprintf(stderr, "CheckpointError: %s\n", e.what());
          code = std::string(e.what()).find(path) != std::string::npos ? 0 : 2;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "other error: %s\n", e.what());
        }
        std::_Exit(code);
      },
      ::testing::ExitedWithCode(0), "CheckpointError: .*bad_utf8_device.safetensors: .*tensor #1's name");
}

// On the CPU path too, a name that is not valid UTF-8 is named by its place.
TEST(CheckpointErrors, NameThatCannotBeEncodedNamesTheFileAndTensor) {
  const std::string path = TmpPath("bad_utf8_cpu.safetensors");
  EXPECT_THAT(ErrorOf([&] { SaveTensors(path, {{"ok", Ones({1})}, {std::string("w\xff"), Ones({2})}}); }),
              AllOf(HasSubstr(path), HasSubstr("tensor #1's name")));
  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0);
}

// A device record naming a 1 MB tensor name, or one given twice, or a
// long non-integer epoch, gives a short message.
TEST(DeviceMap, MessagesAboutTheDeviceRecordStayShort) {
  const float v = 1.0f;
  const std::string path = TmpPath("long_devices.safetensors");
  const std::string name(1 << 20, 'n');
  for (const std::string& record : {"{\"" + name + "\": \"cuda:0\"}", "{\"" + name + "\": 3}",
                                    "{\"" + name + "\": 1, \"" + name + "\": 2}"}) {
    WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, record}});
    const std::string error = ErrorOf([&] { LoadTensors(path); });
    EXPECT_THAT(error, AllOf(HasSubstr(path), HasSubstr("ddp.devices")));
    EXPECT_LT(error.size(), 1024u + path.size());
  }
  const std::string epoch = ErrorOf([&] { MetadataInt({{"epoch", name}}, "epoch", "c.safetensors"); });
  EXPECT_THAT(epoch, AllOf(HasSubstr("c.safetensors"), HasSubstr("expected an integer")));
  EXPECT_LT(epoch.size(), 1024u);
  std::remove(path.c_str());
}

TEST(DeviceMap, MalformedDeviceRecordNamesTheFile) {
  const float v = 1.0f;
  const std::string path = TmpPath("bad_devices.safetensors");
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, "not json"}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("ddp.devices"), HasSubstr("malformed")));
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, R"({"w": "cuda:x"})"}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }), AllOf(HasSubstr(path), HasSubstr("malformed")));
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, R"({"v": "cuda:0"})"}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }), HasSubstr("names tensor `v`, which the file does not hold"));
  // Before, the parser kept the last device given for `w` silently.
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}},
                       {{kDevicesKey, R"({"w": "cuda:0", "w": "cpu"})"}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("malformed"), HasSubstr("key `w` appears twice")));
}

// The record is a flat object, and nesting is refused where the parser
// meets it: before, a record of millions of nested brackets in a file's
// metadata was parsed twice into as many nested values (1.6 GB and 13 s
// for a 40 MB header) before being refused as not an object.
TEST(DeviceMap, DeviceRecordNestedDeeperThanAFlatObjectIsRefusedUnparsed) {
  const float v = 1.0f;
  const std::string path = TmpPath("deep_devices.safetensors");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, deep}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("ddp.devices"), HasSubstr("JSON nests deeper than 1 level")));
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, R"({"w": {"d": "cpu"}})"}});
  EXPECT_THAT(ErrorOf([&] { LoadTensors(path); }),
              AllOf(HasSubstr(path), HasSubstr("ddp.devices"), HasSubstr("JSON nests deeper than 1 level")));
  WriteSafetensorsFile(path, {{"w", StDtype::kF32, {1}, &v, sizeof(v)}}, {{kDevicesKey, R"({"w": "cpu"})"}});
  EXPECT_EQ(LoadTensors(path).tensors.size(), 1u);
}

}  // namespace
}  // namespace ddp::nn::io
