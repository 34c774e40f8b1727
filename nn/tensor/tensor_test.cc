#include "nn/tensor/tensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "nn/tensor/generator.h"

namespace ddp::nn {
namespace {

Tensor Iota(const Shape& shape, DType dtype = DType::kFloat32) {
  std::vector<double> v(NumElements(shape));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  return FromVector(v, shape, {.dtype = dtype});
}

template <typename Fn>
std::string ErrorOf(Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(TensorTest, FactoriesSetShapeStridesDtypeAndAlignment) {
  Tensor t = Zeros({2, 3, 4}, {.dtype = DType::kFloat64});
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.dtype(), DType::kFloat64);
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % kCpuAlignment, 0u);
  for (double v : t.ToVector<double>()) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(Full({2}, 2.5).ToVector<float>(), (std::vector<float>{2.5f, 2.5f}));
  EXPECT_EQ(Arange(4, {.dtype = DType::kInt64}).ToVector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3}));
  Tensor scalar = Full({}, 7.0);
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.Item(), 7.0);
}

TEST(TensorTest, TypedAccessChecksDtype) {
  Tensor t = Zeros({2});
  EXPECT_NO_THROW(t.data<float>());
  EXPECT_NE(ErrorOf([&] { t.data<double>(); }).find("dtype f32, accessed as f64"), std::string::npos);
}

TEST(TensorTest, ViewOfContiguousAndOfTransposedTensors) {
  Tensor t = Iota({2, 3, 4});
  Tensor v = t.View({6, -1});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_EQ(v.storage().get(), t.storage().get());
  // A transposed tensor can still be viewed when only the untouched dims merge.
  Tensor tt = t.Transpose(1, 2);  // [2, 4, 3] strides [12, 1, 4]
  Tensor merged = tt.View({2, 4, 3});
  EXPECT_EQ(merged.strides(), (Shape{12, 1, 4}));
  Tensor split = t.Transpose(0, 1).View({3, 2, 2, 2});  // splitting the last dim is fine
  EXPECT_EQ(split.strides(), (Shape{4, 12, 2, 1}));
  std::string err = ErrorOf([&] { tt.View({8, 3}); });
  EXPECT_NE(err.find("cannot be expressed"), std::string::npos) << err;
  Tensor r = tt.Reshape({8, 3});  // copies
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.ToVector<float>()[1], 4.0f);  // tt[0][0][1] = t[0][1][0]
  EXPECT_NE(ErrorOf([&] { t.View({5, -1}); }).find("invalid for 24 elements"), std::string::npos);
}

// A -1 beside a 0 over no elements could be any size: the shape is refused
// as ambiguous (as PyTorch refuses it), not as "invalid for 0 elements",
// which read as if the sizes were wrong. Over some elements the same shape
// is simply invalid.
TEST(TensorTest, AMinusOneBesideAZeroOverNoElementsIsAmbiguous) {
  for (const Shape& shape : {Shape{0, -1}, Shape{-1, 3, 0}}) {
    for (const bool reshape : {false, true}) {
      const std::string err =
          ErrorOf([&] { reshape ? Zeros({0, 4}).Reshape(shape) : Zeros({0, 4}).View(shape); });
      EXPECT_NE(err.find("shape " + ShapeToString(shape) +
                         " is ambiguous for a tensor of 0 elements: its -1 could stand for any size"),
                std::string::npos)
          << err;
    }
  }
  EXPECT_NE(ErrorOf([] { Zeros({2, 3}).View({0, -1}); }).find("shape [0, -1] is invalid for 6 elements"),
            std::string::npos);
  EXPECT_EQ(Zeros({0, 4}).View({-1, 4}).shape(), (Shape{0, 4}));
}

TEST(TensorTest, TransposePermuteNarrowSliceSelect) {
  Tensor t = Iota({3, 4});
  Tensor tr = t.Transpose(0, 1);
  EXPECT_EQ(tr.shape(), (Shape{4, 3}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.Contiguous().ToVector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor p = Iota({2, 3, 4}).Permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  Tensor n = t.Narrow(1, 1, 2);
  EXPECT_EQ(n.ToVector<float>(), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  Tensor s = t.Slice(1, 0, 4, 2);
  EXPECT_EQ(s.ToVector<float>(), (std::vector<float>{0, 2, 4, 6, 8, 10}));
  Tensor row = t.Select(0, -1);
  EXPECT_EQ(row.ToVector<float>(), (std::vector<float>{8, 9, 10, 11}));
  EXPECT_NE(ErrorOf([&] { t.Narrow(1, 3, 2); }).find("outside shape [3, 4]"), std::string::npos);
  // A negative start counts from the end, as torch.narrow's.
  EXPECT_EQ(t.Narrow(1, -2, 2).ToVector<float>(), (std::vector<float>{2, 3, 6, 7, 10, 11}));
  EXPECT_NE(ErrorOf([&] { t.Narrow(1, -5, 1); }).find("outside shape [3, 4]"), std::string::npos);
  // A start counted from the end is reported as given, not as wrapped (it read "from 2").
  EXPECT_EQ(ErrorOf([&] { t.Narrow(1, -2, 5); }), "Narrow: 5 elements from -2 of dimension 1 are outside shape [3, 4]");
  EXPECT_NE(ErrorOf([&] { t.Select(0, 3); }).find("index 3 out of range"), std::string::npos);
  // The index as given, not as wrapped (-5 of 3 was reported as -2), and the valid range.
  EXPECT_EQ(ErrorOf([] { Ones({2, 3}).Select(1, -5); }),
            "Select: index -5 out of range for dimension 1 of shape [2, 3] (valid: [-3, 2])");
  EXPECT_EQ(ErrorOf([] { Ones({2, 0}).Select(-1, 0); }),
            "Select: index 0 out of range for dimension 1 of shape [2, 0] (valid: none, the dimension is empty)");
  EXPECT_EQ(Ones({2, 3}).Select(1, -3).shape(), (Shape{2}));
  EXPECT_NE(ErrorOf([&] { t.Transpose(0, 2); }).find("dimension 2 out of range"), std::string::npos);
}

TEST(TensorTest, UnsqueezeSqueezeExpandFlatten) {
  Tensor t = Iota({3});
  Tensor u = t.Unsqueeze(0);
  EXPECT_EQ(u.shape(), (Shape{1, 3}));
  EXPECT_EQ(u.Squeeze(0).shape(), (Shape{3}));
  EXPECT_EQ(Full({}, 7).Squeeze(0).shape(), (Shape{}));  // a scalar stays one, as in PyTorch
  EXPECT_EQ(Full({}, 7).Squeeze(-1).Item(), 7);
  Tensor e = t.Unsqueeze(1).Expand({3, 2});
  EXPECT_EQ(e.strides(), (Shape{1, 0}));
  EXPECT_EQ(e.Contiguous().ToVector<float>(), (std::vector<float>{0, 0, 1, 1, 2, 2}));
  EXPECT_NE(ErrorOf([&] { t.Expand({4}); }).find("cannot expand shape [3] to [4]"), std::string::npos);
  EXPECT_EQ(Iota({2, 3, 4}).Flatten(1).shape(), (Shape{2, 12}));
}

// Sizes and steps near the int64 range are refused or computed without
// overflow: Narrow(0, 1, INT64_MAX) passed its check (start + length
// wrapped) and viewed past the storage; a negative Expand size was kept.
TEST(TensorTest, ViewsRefuseSizesThatOverflowOrAreNegative) {
  const Tensor t = Zeros({4, 1});
  EXPECT_THROW(t.Narrow(0, 1, std::numeric_limits<int64_t>::max()), std::out_of_range);
  EXPECT_THROW(t.Narrow(0, 5, 0), std::out_of_range);
  EXPECT_EQ(t.Narrow(0, 4, 0).shape(), (Shape{0, 1}));
  EXPECT_THROW(t.Expand({4, -5}), std::invalid_argument);
  EXPECT_EQ(t.Expand({4, 0}).numel(), 0);
  const Tensor s = t.Slice(0, 0, 4, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(s.shape(), (Shape{1, 1}));
  EXPECT_EQ(t.Slice(0, 1, 4, 2).shape(), (Shape{2, 1}));
  EXPECT_EQ(t.Slice(0, 1, 4, 2).strides(), (Shape{2, 1}));
  EXPECT_EQ(t.Slice(0, 2, 2, 3).shape(), (Shape{0, 1}));
}

// Floating values an integer dtype cannot hold convert to the nearest end
// of its range, NaN to 0 (a plain cast is undefined behaviour there).
TEST(TensorTest, FloatsOutsideAnIntegerRangeSaturate) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(FromVector({300.0, -1.0, 7.9, std::nan("")}, {4}).To(DType::kUInt8).ToVector<int64_t>(),
            (std::vector<int64_t>{255, 0, 7, 0}));
  EXPECT_EQ(FromVector({inf, -inf, 1e30, -3.5}, {4}).To(DType::kInt32).ToVector<int64_t>(),
            (std::vector<int64_t>{2147483647, -2147483648LL, 2147483647, -3}));
  EXPECT_EQ(FromVector({inf, -inf}, {2}).To(DType::kInt64).ToVector<int64_t>(),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}));
}

TEST(TensorTest, CopyFromBroadcastsConvertsAndHandlesStrides) {
  Tensor dst = Zeros({2, 3}, {.dtype = DType::kFloat64});
  dst.CopyFrom(FromVector({1, 2, 3}, {3}));
  EXPECT_EQ(dst.ToVector<double>(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  Tensor col = Zeros({3, 2});
  col.Transpose(0, 1).CopyFrom(Iota({2, 3}, DType::kInt64));  // write through a transposed view
  EXPECT_EQ(col.ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  const uint64_t before = col.storage()->version();
  col.Fill(1);
  EXPECT_GT(col.storage()->version(), before);
  EXPECT_NE(ErrorOf([&] { dst.CopyFrom(Zeros({4})); }).find("cannot be broadcast"), std::string::npos);
}

// Source and destination in one memory: read as it was before the copy
// (an element is not overwritten before it is read); a destination with
// several elements at one address (an expanded view) is refused.
TEST(TensorTest, CopyFromOverlappingMemory) {
  Tensor x = FromVector({1, 2, 3, 4}, {2, 2});
  x.CopyFrom(x.Transpose(0, 1));
  EXPECT_EQ(x.ToVector<float>(), (std::vector<float>{1, 3, 2, 4}));
  Tensor y = Iota({6});
  y.Narrow(0, 1, 5).CopyFrom(y.Narrow(0, 0, 5));  // shift right by one
  EXPECT_EQ(y.ToVector<float>(), (std::vector<float>{0, 0, 1, 2, 3, 4}));
  Tensor z = Iota({3});
  const uint64_t before = z.storage()->version();
  z.CopyFrom(z);
  EXPECT_EQ(z.ToVector<float>(), (std::vector<float>{0, 1, 2}));
  EXPECT_GT(z.storage()->version(), before);
  Tensor e = Zeros({3}).Unsqueeze(1).Expand({3, 2});
  EXPECT_NE(ErrorOf([&] { e.CopyFrom(Iota({3, 2})); }).find("several elements at one memory location"),
            std::string::npos);
}

// Two FromBlob tensors over overlapping memory have separate storages: the
// overlap is found by address, and the copy reads the source as it was, as
// within one storage. (Only storage identity was checked: the transposed
// copy read an element it had already overwritten and gave {1, 3, 3, 4}.)
TEST(TensorTest, CopyFromOverlappingBlobs) {
  float buf[4] = {1, 2, 3, 4};
  Tensor a = Tensor::FromBlob(buf, {2, 2}, DType::kFloat32);
  Tensor b = Tensor::FromBlob(buf, {2, 2}, DType::kFloat32);
  ASSERT_NE(a.storage(), b.storage());
  b.CopyFrom(a.Transpose(0, 1));
  EXPECT_EQ(a.ToVector<float>(), (std::vector<float>{1, 3, 2, 4}));
  // Partly overlapping, the destination strided (no memmove): every other
  // element from buf[1] on takes buf[0..2] as they were.
  double v[7] = {0, 1, 2, 3, 4, 5, 6};
  Tensor src = Tensor::FromBlob(v, {3}, DType::kFloat64);
  Tensor dst = Tensor::FromBlob(v + 1, {6}, DType::kFloat64).Slice(0, 0, 6, 2);
  dst.CopyFrom(src);
  EXPECT_EQ(std::vector<double>(v, v + 7), (std::vector<double>{0, 0, 2, 1, 4, 2, 6}));
}

TEST(TensorTest, FillOnStridedViewTouchesOnlyTheView) {
  Tensor t = Zeros({4, 4});
  t.Slice(1, 0, 4, 2).Fill(5);
  std::vector<float> v = t.ToVector<float>();
  EXPECT_EQ(v[0], 5);
  EXPECT_EQ(v[1], 0);
  EXPECT_EQ(v[2], 5);
}

TEST(TensorTest, DtypeConversionsRoundTrip) {
  Tensor t = FromVector({1.5, -2.25, 1000}, {3});
  EXPECT_EQ(t.To(DType::kBFloat16).To(DType::kFloat32).ToVector<float>(), (std::vector<float>{1.5f, -2.25f, 1000}));
  EXPECT_EQ(t.To(DType::kFloat16).ToVector<double>(), (std::vector<double>{1.5, -2.25, 1000}));
  EXPECT_EQ(t.To(DType::kInt64).ToVector<int64_t>(), (std::vector<int64_t>{1, -2, 1000}));
}

// f64 tensors convert to f16 and bf16 in one rounding (To, Fill, sums
// accumulated in f64): a value a hair above the midpoint of two neighbours
// rounds up. Through f32 it became the midpoint and went to the even one.
TEST(TensorTest, F64ToSixteenBitsRoundsOnce) {
  const double above_tie_h = 1.0 + 0x1p-11 + 0x1p-30, above_tie_b = 1.0 + 0x1p-8 + 0x1p-40;
  const Tensor h = FromVector({above_tie_h, 65520.0 - 0x1p-20}, {2}, {.dtype = DType::kFloat64}).To(DType::kFloat16);
  EXPECT_EQ(h.data<Half>()[0].bits, 0x3c01);
  EXPECT_EQ(h.data<Half>()[1].bits, 0x7bff);  // the largest finite, not inf
  EXPECT_EQ(Full({1}, above_tie_h, {.dtype = DType::kFloat16}).data<Half>()[0].bits, 0x3c01);
  const Tensor b = FromVector({above_tie_b}, {1}, {.dtype = DType::kFloat64}).To(DType::kBFloat16);
  EXPECT_EQ(b.data<BFloat16>()[0].bits, 0x3f81);
  EXPECT_EQ(Full({1}, above_tie_b, {.dtype = DType::kBFloat16}).data<BFloat16>()[0].bits, 0x3f81);
}

TEST(TensorTest, FromStorageSharesMemoryAndChecksBounds) {
  Tensor flat = Zeros({10});
  Tensor view = Tensor::FromStorage(flat.storage(), 4, {2, 3}, {3, 1}, DType::kFloat32);
  view.Fill(2);
  EXPECT_EQ(flat.ToVector<float>()[4], 2);
  EXPECT_EQ(flat.ToVector<float>()[9], 2);
  EXPECT_EQ(flat.ToVector<float>()[3], 0);
  EXPECT_NE(ErrorOf([&] { Tensor::FromStorage(flat.storage(), 5, {2, 3}, {3, 1}, DType::kFloat32); })
                .find("reach past the storage"),
            std::string::npos);
}

// Shapes whose element or byte count leaves int64 are refused before any
// allocation, as PyTorch's "Storage size calculation overflowed"; wrapped
// around they would describe a tiny buffer.
TEST(TensorTest, SizeOverflowIsRefused) {
  const int64_t big = int64_t{1} << 32;
  std::string err = ErrorOf([&] { Empty({big, big}); });
  EXPECT_NE(err.find("Empty: storage size calculation overflowed for shape [4294967296, 4294967296]"),
            std::string::npos)
      << err;
  EXPECT_THROW(Empty({big, big}), std::invalid_argument);
  // 2^62 elements fit in int64, their 2^64 bytes (f32) do not.
  err = ErrorOf([&] { Empty({int64_t{1} << 62}); });
  EXPECT_NE(err.find("Empty (f32): storage size calculation overflowed for shape [4611686018427387904]"),
            std::string::npos)
      << err;
  EXPECT_THROW(Zeros({big, big, 0}), std::invalid_argument);  // as PyTorch: overflows before the 0
  float buf[4] = {};
  EXPECT_THROW(Tensor::FromBlob(buf, {big, big}, DType::kFloat32), std::invalid_argument);
  EXPECT_THROW(NumElements({big, big}), std::invalid_argument);
  EXPECT_EQ(NumElements({big, int64_t{1} << 30}), int64_t{1} << 62);
  // A view's shape is checked too, even over no elements.
  EXPECT_THROW(Zeros({0}).View({big, big, 0}), std::invalid_argument);
  EXPECT_THROW(Zeros({2}).Expand({big, big, 2}), std::invalid_argument);
}

// Strides and offsets that reach past int64 are out of range, not wrapped
// back into the storage.
TEST(TensorTest, FromStorageRefusesStridesThatOverflow) {
  Tensor flat = Zeros({10});
  const int64_t max = std::numeric_limits<int64_t>::max();
  std::string err = ErrorOf([&] { Tensor::FromStorage(flat.storage(), 0, {2}, {max}, DType::kFloat32); });
  EXPECT_NE(err.find("FromStorage: storage size calculation overflowed for shape [2] strides [" +
                     std::to_string(max) + "]"),
            std::string::npos)
      << err;
  EXPECT_THROW(Tensor::FromStorage(flat.storage(), 0, {2}, {max}, DType::kFloat32), std::out_of_range);
  // (2^62 + 1) * 4 bytes wraps around to 4: must not pass as "inside 40 bytes".
  EXPECT_THROW(Tensor::FromStorage(flat.storage(), 0, {2}, {int64_t{1} << 62}, DType::kFloat32), std::out_of_range);
  EXPECT_THROW(Tensor::FromStorage(flat.storage(), max, {1}, {1}, DType::kFloat32), std::out_of_range);
  EXPECT_THROW(flat.AsStrided({3, 2}, {max / 2, 1}, 0), std::out_of_range);
  // Stride 0 repeats one element: many elements, few bytes, allowed.
  EXPECT_EQ(flat.AsStrided({int64_t{1} << 40}, {0}, 9).numel(), int64_t{1} << 40);
}

// A negative offset or stride is refused even for a view with no elements
// (torch.as_strided refuses both whatever the sizes), and the error names
// the value and, for a stride, its dimension.
TEST(TensorTest, FromStorageRefusesNegativeOffsetAndStridesOfEmptyViews) {
  Tensor flat = Zeros({10});
  std::string err = ErrorOf([&] { flat.AsStrided({0}, {1}, -1); });
  EXPECT_NE(err.find("FromStorage: storage offset -1 is negative"), std::string::npos) << err;
  EXPECT_THROW(flat.AsStrided({0, 3}, {3, 1}, -4), std::out_of_range);
  err = ErrorOf([&] { flat.AsStrided({0, 2}, {1, -2}, 0); });
  EXPECT_NE(err.find("FromStorage: stride -2 of dimension 1 in strides [1, -2] is negative"), std::string::npos)
      << err;
  err = ErrorOf([&] { flat.AsStrided({2, 2}, {-1, 1}, 4); });
  EXPECT_NE(err.find("stride -1 of dimension 0"), std::string::npos) << err;
  // An empty view may still sit anywhere at or after the storage's start.
  EXPECT_EQ(flat.AsStrided({0}, {1}, 25).storage_offset(), 25);
}

// Bad arguments to Unsqueeze, Expand and Flatten are named in the error,
// with the shape they were given for; a 0-d tensor flattens only over
// dimension 0 or -1, as in PyTorch.
TEST(TensorTest, ViewErrorsNameTheBadArgument) {
  std::string err = ErrorOf([&] { Zeros({2, 3}).Unsqueeze(-4); });
  EXPECT_NE(err.find("Unsqueeze: dimension -4 out of range for shape [2, 3] (expected -3 to 2)"), std::string::npos)
      << err;
  EXPECT_THROW(Zeros({2, 3}).Unsqueeze(3), std::out_of_range);
  EXPECT_EQ(Zeros({2, 3}).Unsqueeze(-3).shape(), (Shape{1, 2, 3}));
  err = ErrorOf([&] { Zeros({3}).Expand({-1, 3}); });
  EXPECT_NE(err.find("Expand: size -1 in new leading dimension 0 of [-1, 3]"), std::string::npos) << err;
  err = ErrorOf([&] { Zeros({3}).Expand({2, -7, 3}); });
  EXPECT_NE(err.find("size -7 in new leading dimension 1"), std::string::npos) << err;
  err = ErrorOf([&] { Zeros({2, 3, 4}).Flatten(2, 1); });
  EXPECT_NE(err.find("Flatten: start dimension 2 comes after end dimension 1 in shape [2, 3, 4]"),
            std::string::npos)
      << err;
  EXPECT_EQ(Full({}, 1.0).Flatten(0, -1).shape(), (Shape{1}));
  err = ErrorOf([&] { Full({}, 1.0).Flatten(1); });
  EXPECT_NE(err.find("Flatten: dimension 1 out of range for a 0-d tensor"), std::string::npos) << err;
  EXPECT_THROW(Full({}, 1.0).Flatten(0, -2), std::out_of_range);
}

// A 0-d tensor transposes over dimension 0 (or -1) with itself, as
// torch.tensor(3.).transpose(0, -1), and refuses any other dimension.
TEST(TensorTest, TransposeOfAScalarTakesDimZeroOrMinusOne) {
  const Tensor s = Full({}, 3.0);
  for (const auto& [d0, d1] : {std::pair<int64_t, int64_t>{0, 0}, {0, -1}, {-1, 0}, {-1, -1}}) {
    const Tensor t = s.Transpose(d0, d1);
    EXPECT_EQ(t.shape(), Shape{});
    EXPECT_EQ(t.data_ptr(), s.data_ptr());
    EXPECT_EQ(t.Item(), 3.0);
  }
  const std::string err = ErrorOf([&] { s.Transpose(0, 1); });
  EXPECT_NE(err.find("Transpose: dimension 1 out of range for a 0-d tensor"), std::string::npos) << err;
  EXPECT_THROW(s.Transpose(-2, 0), std::out_of_range);
}

TEST(TensorTest, FromBlobWrapsWithoutCopyAndRunsDeleter) {
  bool deleted = false;
  float buf[4] = {1, 2, 3, 4};
  {
    Tensor t = Tensor::FromBlob(buf, {2, 2}, DType::kFloat32, kCPU, [&](void*) { deleted = true; });
    t.Fill(9);
  }
  EXPECT_TRUE(deleted);
  EXPECT_EQ(buf[3], 9);
}

TEST(TensorTest, CudaWithoutBackendIsAClearError) {
  if (HasDeviceBackend(DeviceType::kCUDA)) GTEST_FAIL() << "test assumes a CPU-only build";
  std::string err = ErrorOf([] { Empty({2}, {.device = Device(DeviceType::kCUDA, 0)}); });
  EXPECT_NE(err.find("device cuda:0 is not available"), std::string::npos) << err;
  EXPECT_EQ(Device::Parse("cuda:3"), Device(DeviceType::kCUDA, 3));
  EXPECT_NE(ErrorOf([] { Device::Parse("gpu"); }).find("unknown device `gpu`"), std::string::npos);
}

TEST(TensorTest, AutogradMetadataRules) {
  Tensor w = Zeros({2, 3});
  EXPECT_FALSE(w.requires_grad());
  w.set_requires_grad(true);
  EXPECT_TRUE(w.requires_grad());
  EXPECT_TRUE(w.is_leaf());
  EXPECT_FALSE(w.grad().defined());
  // Member views would drop history: refused while grad mode is on.
  std::string err = ErrorOf([&] { w.View({6}); });
  EXPECT_NE(err.find("would drop its autograd history"), std::string::npos) << err;
  EXPECT_NE(err.find("ops::View"), std::string::npos) << err;
  // The advice names a function that exists: ops has Cast, no AsStrided and no device move.
  err = ErrorOf([&] { w.To(DType::kFloat64); });
  EXPECT_NE(err.find("Tensor::To(dtype)"), std::string::npos) << err;
  EXPECT_NE(err.find("ops::Cast"), std::string::npos) << err;
  err = ErrorOf([&] { w.AsStrided({3}, {1}, 0); });
  EXPECT_NE(err.find("no differentiable AsStrided"), std::string::npos) << err;
  EXPECT_EQ(err.find("ops::AsStrided"), std::string::npos) << err;
  err = ErrorOf([&] { w.To(kCPU); });
  EXPECT_NE(err.find("no differentiable To(device)"), std::string::npos) << err;
  EXPECT_NE(ErrorOf([&] { w.Fill(1); }).find("NoGradGuard"), std::string::npos);
  {
    NoGradGuard guard;
    EXPECT_FALSE(GradMode::IsEnabled());
    EXPECT_NO_THROW(w.View({6}));
    EXPECT_NO_THROW(w.Fill(1));
  }
  EXPECT_TRUE(GradMode::IsEnabled());
  EXPECT_NO_THROW(w.Detach().View({6}));
  EXPECT_FALSE(w.Detach().requires_grad());
  // .grad may be a view into a flat bucket; the shape must match.
  Tensor bucket = Zeros({10});
  w.set_grad(bucket.Narrow(0, 2, 6).View({2, 3}));
  EXPECT_EQ(w.grad().storage().get(), bucket.storage().get());
  err = ErrorOf([&] { w.set_grad(Zeros({3, 2})); });
  EXPECT_NE(err.find("does not match tensor [2, 3]"), std::string::npos) << err;
  // An expanded view would take every element's gradient at each location.
  err = ErrorOf([&] { w.set_grad(Zeros({1, 3}).Expand({2, 3})); });
  EXPECT_NE(err.find("set_grad: the gradient [2, 3] has several elements at one memory location (stride 0 in "
                     "dimension 0"),
            std::string::npos)
      << err;
  EXPECT_NE(ErrorOf([] { Zeros({2}, {.dtype = DType::kInt64}).set_requires_grad(true); })
                .find("only floating-point"),
            std::string::npos);
}

TEST(TensorTest, HooksRegisterAndRemove) {
  Tensor w = Zeros({2}, {.requires_grad = true});
  int calls = 0;
  HookHandle h = w.RegisterPostAccumulateGradHook([&](const Tensor&) { ++calls; });
  ASSERT_EQ(w.impl()->autograd()->post_accumulate_hooks.size(), 1u);
  h.Remove();
  h.Remove();  // idempotent
  EXPECT_TRUE(w.impl()->autograd()->post_accumulate_hooks.empty());
  EXPECT_NE(ErrorOf([] { Zeros({2}).RegisterPostAccumulateGradHook([](const Tensor&) {}); })
                .find("leaf tensors that require grad"),
            std::string::npos);
}

TEST(TensorTest, HookHandleKnowsWhetherItsHookRunsLast) {
  Tensor w = Zeros({2}, {.requires_grad = true});
  HookHandle first = w.RegisterPostAccumulateGradHook([](const Tensor&) {});
  EXPECT_TRUE(first.IsLast());
  HookHandle second = w.RegisterPostAccumulateGradHook([](const Tensor&) {});
  EXPECT_FALSE(first.IsLast());
  EXPECT_TRUE(second.IsLast());
  second.Remove();
  EXPECT_FALSE(second.IsLast());
  EXPECT_TRUE(first.IsLast());
  EXPECT_FALSE(HookHandle().IsLast());
}

TEST(TensorTest, SetDataKeepsTheObject) {
  Tensor w = Zeros({2}, {.requires_grad = true});
  Tensor alias = w;
  w.SetData(Ones({3}, {.dtype = DType::kFloat64}));
  EXPECT_EQ(alias.shape(), (Shape{3}));
  EXPECT_EQ(alias.dtype(), DType::kFloat64);
  EXPECT_TRUE(alias.requires_grad());
}

// Expected strings were produced by PyTorch 1.13's str(tensor).
TEST(TensorPrintTest, MatchesPyTorch) {
  EXPECT_EQ(FromVector({1, 2, 3, 4}, {2, 2}).ToString(), "tensor([[1., 2.],\n        [3., 4.]])");
  EXPECT_EQ(FromVector({0.5, -1.25, 3.0}, {3}).ToString(), "tensor([ 0.5000, -1.2500,  3.0000])");
  EXPECT_EQ(Full({}, 3.5).ToString(), "tensor(3.5000)");
  EXPECT_EQ(FromVector({1e-5, 1.0}, {2}).ToString(), "tensor([1.0000e-05, 1.0000e+00])");
  EXPECT_EQ(Iota({2, 2, 2}).ToString(),
            "tensor([[[0., 1.],\n         [2., 3.]],\n\n        [[4., 5.],\n         [6., 7.]]])");
  EXPECT_EQ(Iota({2000}).ToString(),
            "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n"
            "        1.9990e+03])");
  EXPECT_EQ(Arange(3, {.dtype = DType::kInt64}).ToString(), "tensor([0, 1, 2])");
  EXPECT_EQ(Ones({2}, {.requires_grad = true}).ToString(), "tensor([1., 1.], requires_grad=True)");
  EXPECT_EQ(Zeros({0, 3}).ToString(), "tensor([], size=(0, 3))");
  std::vector<double> v(30);
  for (int i = 0; i < 30; ++i) v[i] = 1.5 * i;
  EXPECT_EQ(FromVector(v, {30}).ToString(),
            "tensor([ 0.0000,  1.5000,  3.0000,  4.5000,  6.0000,  7.5000,  9.0000, 10.5000,\n"
            "        12.0000, 13.5000, 15.0000, 16.5000, 18.0000, 19.5000, 21.0000, 22.5000,\n"
            "        24.0000, 25.5000, 27.0000, 28.5000, 30.0000, 31.5000, 33.0000, 34.5000,\n"
            "        36.0000, 37.5000, 39.0000, 40.5000, 42.0000, 43.5000])");
  std::string big = Iota({100, 30}).ToString();
  EXPECT_EQ(big.substr(0, 96),
            "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 2.7000e+01, 2.8000e+01,\n"
            "         2.9000e+01],");
  EXPECT_NE(big.find("        ...,\n        [2.9100e+03"), std::string::npos) << big;
  EXPECT_EQ(FromVector({1, 2}, {2}, {.dtype = DType::kBFloat16}).ToString(), "tensor([1., 2.], dtype=bf16)");
}

// Integer tensors print their exact values: through double, 2^53 + 1 would
// round to 2^53 and INT64_MAX would wrap to INT64_MIN.
TEST(TensorPrintTest, Int64PrintsExactValues) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  const int64_t min = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(FromVectorOf<int64_t>({max, min, (int64_t{1} << 53) + 1}, {3}).ToString(),
            "tensor([ 9223372036854775807, -9223372036854775808,     9007199254740993])");
  EXPECT_EQ(FromVectorOf<int64_t>({max}, {}).ToString(), "tensor(9223372036854775807)");
}

// Views print their own elements (read through their strides), and a
// summarized view the same edges as its contiguous copy.
TEST(TensorPrintTest, ViewsPrintTheirElements) {
  Tensor t = Iota({2, 3}).Transpose(0, 1);
  EXPECT_EQ(t.ToString(), "tensor([[0., 3.],\n        [1., 4.],\n        [2., 5.]])");
  Tensor big = Iota({40, 50}).Transpose(0, 1).Narrow(0, 5, 30);
  EXPECT_EQ(big.ToString(), big.Contiguous().ToString());
  EXPECT_NE(big.ToString().find("...,\n"), std::string::npos);
}

// Arguments torch refuses are refused here too, naming the value.
TEST(GeneratorTest, FillsRejectBadBoundsNamingThem) {
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  Tensor t = Empty({4});
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(error_of([&] { UniformFill(t, 2.0, 1.0); }), "UniformFill: low 2 is greater than high 1");
  EXPECT_EQ(error_of([&] { UniformFill(t, -inf, 1.0); }), "UniformFill: bounds must be finite, got low -inf and high 1");
  EXPECT_EQ(error_of([&] { UniformFill(t, 0.0, nan); }), "UniformFill: bounds must be finite, got low 0 and high nan");
  EXPECT_EQ(error_of([&] { NormalFill(t, 0.0, -0.5); }), "NormalFill: std -0.5 must be finite and >= 0");
  EXPECT_EQ(error_of([&] { NormalFill(t, 0.0, nan); }), "NormalFill: std nan must be finite and >= 0");
  EXPECT_EQ(error_of([&] { NormalFill(t, 0.0, inf); }), "NormalFill: std inf must be finite and >= 0");
  EXPECT_EQ(error_of([&] { NormalFill(t, nan, 1.0); }), "NormalFill: mean nan must be finite");
  EXPECT_EQ(error_of([&] { Arange(-1); }), "Arange: n -1 must be >= 0");
  // The edges torch accepts: equal bounds and std 0 fill a constant.
  UniformFill(t, 3.0, 3.0);
  EXPECT_EQ(t.ToVector<double>(), std::vector<double>(4, 3.0));
  NormalFill(t, 1.5, 0.0);
  EXPECT_EQ(t.ToVector<double>(), std::vector<double>(4, 1.5));
  EXPECT_EQ(Arange(0).numel(), 0);
}

TEST(GeneratorTest, SeededSequencesRepeatAndDiffer) {
  Generator a(42), b(42), c(43);
  for (int i = 0; i < 10; ++i) {
    const uint64_t x = a.NextU64();
    EXPECT_EQ(x, b.NextU64());
    EXPECT_NE(x, c.NextU64());
  }
  Tensor r = Rand({1000}, {}, a);
  for (float v : r.ToVector<float>()) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LT(v, 1.0f);
  }
  Tensor n = Randn({20000}, {.dtype = DType::kFloat64}, a);
  double mean = 0, sq = 0;
  for (double v : n.ToVector<double>()) {
    mean += v;
    sq += v * v;
  }
  mean /= 20000;
  EXPECT_NEAR(mean, 0.0, 0.05);
  EXPECT_NEAR(sq / 20000 - mean * mean, 1.0, 0.05);
  Tensor p = RandPerm(100, a);
  std::vector<int64_t> pv = p.ToVector<int64_t>();
  std::sort(pv.begin(), pv.end());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(pv[i], i);
}

// Rand stays below 1 in every dtype: a draw just under 1.0 rounds to 1.0
// in bf16 about once in 500 and in f16 once in 4096 (it was kept), and is
// taken down to the largest value under 1 instead. Values elsewhere are
// the plain rounding of the same draws.
TEST(GeneratorTest, RandStaysBelowOneInEveryDtype) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    Generator g(7);
    const std::vector<double> v = Rand({1 << 16}, {.dtype = dtype}, g).ToVector<double>();
    Generator reference_gen(7);
    const std::vector<double> f64 = Rand({1 << 16}, {.dtype = DType::kFloat64}, reference_gen).ToVector<double>();
    size_t at_or_past_one = 0, lowered = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      at_or_past_one += v[i] >= 1.0;
      EXPECT_GE(v[i], 0.0) << DTypeName(dtype);
      lowered += v[i] < 1.0 && FromVector({f64[i]}, {1}).To(dtype).ToVector<double>()[0] >= 1.0;
    }
    EXPECT_EQ(at_or_past_one, 0u) << DTypeName(dtype);
    if (dtype == DType::kBFloat16) {
      EXPECT_GT(lowered, 0u) << "no draw rounded up to 1: the test saw nothing";
    }
  }
  Tensor u = Empty({1 << 16}, {.dtype = DType::kBFloat16});
  Generator g(9);
  UniformFill(u, -1.0, 1.0, g);
  for (double x : u.ToVector<double>()) {
    EXPECT_GE(x, -1.0);
    EXPECT_LT(x, 1.0);
  }
}

// The default generator is shared by every thread (a loader worker drawing
// while the main thread initializes a layer). Each fill holds it for its
// whole tensor, so the threads together draw exactly what one thread draws
// from the same seed, each tensor a run of consecutive draws. Unlocked, the
// threads' updates of the state interleave: values repeat, go missing or
// come from no seeded sequence, and TSan reports the race.
TEST(GeneratorTest, DefaultGeneratorIsSafeAcrossThreads) {
  constexpr int kThreads = 4, kFills = 300;
  constexpr int64_t kSize = 257;  // odd: a normal fill leaves a spare value for the next one
  const std::pair<const char*, std::function<Tensor(Generator&)>> kinds[] = {
      {"Rand", [](Generator& g) { return Rand({kSize}, {.dtype = DType::kFloat64}, g); }},
      {"Randn", [](Generator& g) { return Randn({kSize}, {.dtype = DType::kFloat64}, g); }},
  };
  for (const auto& [name, draw] : kinds) {
    SCOPED_TRACE(name);
    ManualSeed(5);
    std::vector<std::vector<std::vector<double>>> fills(kThreads);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ++ready;
        while (ready.load() < kThreads) {  // start together, to overlap the draws
        }
        for (int i = 0; i < kFills; ++i) fills[t].push_back(draw(DefaultGenerator()).ToVector<double>());
      });
    }
    for (std::thread& th : threads) th.join();

    // The reference: the same number of fills, one after another on one thread.
    std::map<double, int64_t> index_of;  // value -> its position in the reference sequence
    Generator reference(5);
    for (int i = 0; i < kThreads * kFills; ++i) {
      const std::vector<double> v = draw(reference).ToVector<double>();
      for (int64_t j = 0; j < kSize; ++j) index_of.emplace(v[j], i * kSize + j);
    }
    ASSERT_EQ(index_of.size(), static_cast<size_t>(kThreads * kFills * kSize)) << "reference values repeat";
    std::vector<bool> seen(kThreads * kFills * kSize, false);
    int bad_fills = 0;
    for (int t = 0; t < kThreads; ++t) {
      for (const std::vector<double>& v : fills[t]) {
        bool ok = true;
        const auto first = index_of.find(v[0]);
        for (int64_t j = 0; ok && j < kSize; ++j) {
          const auto it = index_of.find(v[j]);
          ok = first != index_of.end() && it != index_of.end() && it->second == first->second + j &&
               !seen[it->second];
          if (ok) seen[it->second] = true;
        }
        bad_fills += !ok;
      }
    }
    EXPECT_EQ(bad_fills, 0) << "of " << kThreads * kFills
                            << " fills, these were not a run of consecutive draws of the seeded sequence";
    EXPECT_EQ(std::count(seen.begin(), seen.end(), true), kThreads * kFills * kSize);
  }
}

}  // namespace
}  // namespace ddp::nn
