#include "nn/data/transforms.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace ddp::nn::data {
namespace {

TEST(SampleTransform, ScalesToUnitRangeByDefault) {
  SampleTransform t({1, 1, 4}, {});
  const uint8_t px[4] = {0, 1, 128, 255};
  float out[4];
  t.Apply(px, out, 0, 0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], static_cast<float>(px[i]) / 255.0f);
}

TEST(SampleTransform, NormalizesPerChannelLikeTorchvision) {
  TransformOptions o;
  o.mean = {0.5f, 0.25f};
  o.std = {0.2f, 0.4f};
  SampleTransform t({2, 1, 2}, o);
  const uint8_t px[4] = {0, 200, 17, 255};
  float out[4];
  t.Apply(px, out, 3, 9);
  for (int i = 0; i < 4; ++i) {
    const int c = i / 2;
    EXPECT_EQ(out[i], (static_cast<float>(px[i]) / 255.0f - o.mean[c]) / o.std[c]) << i;
  }
}

// Padding is zero pixels normalized like the others, as torchvision pads
// before ToTensor and Normalize: (0 - mean) / std, not 0. A 1 x 1 image of
// 255 in a 3 x 3 crop with padding 1 (one window position: the pixel in the
// middle). Channel 0, mean 0.5 and std 0.25: padding (0 - 0.5) / 0.25 = -2,
// the pixel (1 - 0.5) / 0.25 = 2. Channel 1, mean 0.25 and std 0.5: -0.5
// and 1.5. All exact in f32.
TEST(SampleTransform, PaddingIsNormalizedLikeAZeroPixel) {
  TransformOptions o;
  o.mean = {0.5f, 0.25f};
  o.std = {0.25f, 0.5f};
  o.random_crop = true;
  o.crop_padding = 1;
  o.crop_height = 3;
  o.crop_width = 3;
  SampleTransform t({2, 1, 1}, o);
  ASSERT_EQ(t.OutputShape(), (ImageShape{2, 3, 3}));
  const uint8_t px[2] = {255, 255};
  std::vector<float> out(18);
  t.Apply(px, out.data(), 0, 0);
  const std::vector<float> want = {-2.0f, -2.0f, -2.0f, -2.0f, 2.0f,  -2.0f, -2.0f, -2.0f, -2.0f,
                                   -0.5f, -0.5f, -0.5f, -0.5f, 1.5f,  -0.5f, -0.5f, -0.5f, -0.5f};
  EXPECT_EQ(out, want);
}

// Reference: pad with zeros, cut at (top, left), mirror if flip.
std::vector<float> Reference(const std::vector<uint8_t>& px, int c, int h, int w, int pad,
                             int oh, int ow, int top, int left, bool flip) {
  std::vector<float> out(c * oh * ow);
  for (int k = 0; k < c; ++k)
    for (int y = 0; y < oh; ++y)
      for (int x = 0; x < ow; ++x) {
        const int xx = flip ? ow - 1 - x : x;
        const int sy = y + top - pad, sx = xx + left - pad;
        const uint8_t v = (sy < 0 || sy >= h || sx < 0 || sx >= w) ? 0 : px[(k * h + sy) * w + sx];
        out[(k * oh + y) * ow + x] = static_cast<float>(v) / 255.0f;
      }
  return out;
}

TEST(SampleTransform, RandomCropAndFlipCoverEveryChoiceAndAreReproducible) {
  const int c = 2, h = 5, w = 6, pad = 2;
  std::vector<uint8_t> px(c * h * w);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i + 1);  // no zeros
  TransformOptions o;
  o.random_crop = true;
  o.crop_padding = pad;
  o.horizontal_flip = true;
  o.seed = 77;
  SampleTransform t({c, h, w}, o);
  ASSERT_EQ(t.OutputShape(), (ImageShape{c, h, w}));
  std::set<std::tuple<int, int, bool>> seen;
  std::vector<float> out(px.size()), again(px.size());
  for (int64_t index = 0; index < 2000; ++index) {
    t.Apply(px.data(), out.data(), 1, index);
    t.Apply(px.data(), again.data(), 1, index);
    ASSERT_EQ(out, again);
    int matches = 0;
    for (int top = 0; top <= 2 * pad; ++top)
      for (int left = 0; left <= 2 * pad; ++left)
        for (bool flip : {false, true})
          if (Reference(px, c, h, w, pad, h, w, top, left, flip) == out) {
            ++matches;
            seen.insert({top, left, flip});
          }
    ASSERT_EQ(matches, 1) << index;
  }
  EXPECT_EQ(seen.size(), 5u * 5u * 2u);
}

// A side with more than 2^24 window positions reaches them all: the
// columns of a 1 x (3 * 2^23) image are 0 up to 2^24 and 255 from there,
// and a 1 x 1 crop lands on a 255 about one time in three (never before:
// the offset was 24 bits of the hash).
TEST(SampleTransform, CropOffsetsPast2To24AreReachable) {
  const int64_t w = 3 * (int64_t{1} << 23);
  std::vector<uint8_t> px(static_cast<size_t>(w), 0);
  std::fill(px.begin() + (int64_t{1} << 24), px.end(), uint8_t{255});
  TransformOptions o;
  o.random_crop = true;
  o.crop_height = 1;
  o.crop_width = 1;
  o.seed = 3;
  SampleTransform t({1, 1, w}, o);
  int far = 0;
  for (int64_t index = 0; index < 300; ++index) {
    float out = -1.0f;
    t.Apply(px.data(), &out, 0, index);
    far += out == 1.0f;
  }
  EXPECT_GT(far, 50);
  EXPECT_LT(far, 150);
}

// The crops of sides with up to 2^24 positions are what they always were:
// a 1 x 1 crop of a 5 x 5 image valued 1..25 shows top * 5 + left + 1,
// recorded from the code before the change (24 bits of the hash each).
TEST(SampleTransform, SmallCropsKeepTheirDraws) {
  TransformOptions o;
  o.random_crop = true;
  o.crop_height = 1;
  o.crop_width = 1;
  o.seed = 77;
  SampleTransform t({1, 5, 5}, o);
  std::vector<uint8_t> px(25);
  for (int i = 0; i < 25; ++i) px[i] = static_cast<uint8_t>(i + 1);
  std::string shown;
  for (int64_t index = 0; index < 16; ++index) {
    float out = 0.0f;
    t.Apply(px.data(), &out, 1, index);
    shown += std::to_string(static_cast<int>(out * 255.0f + 0.5f)) + " ";
  }
  EXPECT_EQ(shown, "5 2 20 6 22 2 16 20 3 6 21 5 2 22 25 10 ");
}

TEST(SampleTransform, EpochChangesTheDraw) {
  TransformOptions o;
  o.random_crop = true;
  o.crop_padding = 4;
  o.horizontal_flip = true;
  SampleTransform t({1, 8, 8}, o);
  std::vector<uint8_t> px(64);
  for (int i = 0; i < 64; ++i) px[i] = static_cast<uint8_t>(3 * i + 1);
  int differ = 0;
  std::vector<float> a(64), b(64);
  for (int64_t index = 0; index < 50; ++index) {
    t.Apply(px.data(), a.data(), 0, index);
    t.Apply(px.data(), b.data(), 1, index);
    differ += a != b;
  }
  EXPECT_GT(differ, 40);
}

TEST(SampleTransform, SmallerCropWindow) {
  TransformOptions o;
  o.random_crop = true;
  o.crop_height = 2;
  o.crop_width = 3;
  SampleTransform t({1, 4, 4}, o);
  EXPECT_EQ(t.OutputShape(), (ImageShape{1, 2, 3}));
  std::vector<uint8_t> px(16);
  for (int i = 0; i < 16; ++i) px[i] = static_cast<uint8_t>(i + 1);
  std::vector<float> out(6);
  for (int64_t index = 0; index < 100; ++index) {
    t.Apply(px.data(), out.data(), 0, index);
    for (float v : out) EXPECT_GT(v, 0.0f);  // never reaches padding
  }
}

// Each bad statistic is refused with its channel and value; before, an
// infinite std or a NaN mean passed and every pixel came out 0 or NaN.
TEST(SampleTransform, RejectsNormalizeStatisticsThatAreNotFinite) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::tuple<std::vector<float>, std::vector<float>, std::string>> cases = {
      {{0.5f, kNan}, {0.5f, 0.5f}, "normalize mean nan for channel 1 must be finite"},
      {{0.5f, -kInf}, {0.5f, 0.5f}, "normalize mean -inf for channel 1 must be finite"},
      {{0.5f, 0.5f}, {kInf, 0.5f}, "normalize std inf for channel 0 must be finite and > 0"},
      {{0.5f, 0.5f}, {0.5f, kNan}, "normalize std nan for channel 1 must be finite and > 0"},
      {{0.5f, 0.5f}, {0.5f, -0.5f}, "normalize std -0.500000 for channel 1 must be finite and > 0"},
      {{kNan}, {0.5f}, "normalize mean nan for all channels must be finite"},
      {{0.5f}, {0.0f}, "normalize std 0.000000 for all channels must be finite and > 0"},
  };
  for (const auto& [mean, stdv, message] : cases) {
    TransformOptions o;
    o.mean = mean;
    o.std = stdv;
    try {
      SampleTransform t({2, 2, 2}, o);
      ADD_FAILURE() << "accepted: " << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST(SampleTransform, RejectsBadOptions) {
  TransformOptions o;
  o.mean = {0.5f, 0.5f};
  o.std = {0.5f};
  EXPECT_THROW(SampleTransform({2, 2, 2}, o), std::invalid_argument);
  o.std = {0.5f, 0.0f};
  EXPECT_THROW(SampleTransform({2, 2, 2}, o), std::invalid_argument);
  o.mean = {0.1f, 0.2f, 0.3f};
  o.std = {1.f, 1.f, 1.f};
  EXPECT_THROW(SampleTransform({2, 2, 2}, o), std::invalid_argument);
  TransformOptions crop;
  crop.random_crop = true;
  crop.crop_height = 9;
  crop.crop_padding = 1;
  EXPECT_THROW(SampleTransform({1, 6, 6}, crop), std::invalid_argument);
}

// Each crop field is checked on its own, and the error names it.
TEST(SampleTransform, RejectsBadCropFieldsNamingThem) {
  auto error_of = [](const TransformOptions& o) -> std::string {
    try {
      SampleTransform({1, 6, 6}, o);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  // Set with the crop off: ignored before, now an error.
  TransformOptions off;
  off.crop_height = 4;
  EXPECT_NE(error_of(off).find("crop_height 4 is set but random_crop is off"), std::string::npos)
      << error_of(off);
  off = {};
  off.crop_width = 4;
  EXPECT_NE(error_of(off).find("crop_width 4"), std::string::npos) << error_of(off);
  off = {};
  off.crop_padding = 2;
  EXPECT_NE(error_of(off).find("crop_padding 2"), std::string::npos) << error_of(off);
  // Negative sizes used to mean "the input's".
  TransformOptions crop;
  crop.random_crop = true;
  crop.crop_height = -3;
  EXPECT_NE(error_of(crop).find("crop_height -3 must be >= 0"), std::string::npos) << error_of(crop);
  crop.crop_height = 0;
  crop.crop_width = -1;
  EXPECT_NE(error_of(crop).find("crop_width -1 must be >= 0"), std::string::npos) << error_of(crop);
  crop.crop_width = 0;
  crop.crop_padding = std::numeric_limits<int64_t>::max() / 2 + 1;
  EXPECT_NE(error_of(crop).find("crop_padding 4611686018427387904"), std::string::npos) << error_of(crop);
  crop.crop_padding = std::numeric_limits<int64_t>::max() / 2 - 2;
  EXPECT_NE(error_of(crop).find("overflows"), std::string::npos) << error_of(crop);
  // A crop whose output image has more than INT64_MAX elements is refused
  // here, naming the crop (it failed only at the first batch's allocation).
  crop.crop_padding = int64_t{1} << 40;
  crop.crop_height = int64_t{1} << 40;
  crop.crop_width = int64_t{1} << 40;
  EXPECT_NE(error_of(crop).find("crop_height 1099511627776 x crop_width 1099511627776 (crop_padding "
                                "1099511627776) gives output images of 1x1099511627776x1099511627776"),
            std::string::npos)
      << error_of(crop);
  crop.crop_height = 0;  // the input's 6: 6 x 2^40 fits
  EXPECT_EQ(SampleTransform({1, 6, 6}, crop).OutputShape(), (ImageShape{1, 6, int64_t{1} << 40}));
  crop.crop_height = 0;
  crop.crop_width = 0;
  // 0 still means unset, with the crop on or off.
  crop.crop_padding = 1;
  EXPECT_EQ(SampleTransform({1, 6, 6}, crop).OutputShape().height, 6);
  EXPECT_EQ(SampleTransform({1, 6, 6}, TransformOptions{}).OutputShape().width, 6);
}

TEST(SampleTransform, PresetsMatchTheImages) {
  SampleTransform fm({1, 28, 28}, FashionMnistNormalize());
  SampleTransform cifar({3, 32, 32}, Cifar10TrainAugment(1));
  EXPECT_EQ(cifar.OutputShape(), (ImageShape{3, 32, 32}));
  EXPECT_THROW(SampleTransform({1, 32, 32}, Cifar10TrainAugment(1)), std::invalid_argument);
}

}  // namespace
}  // namespace ddp::nn::data
