#include "nn/data/transforms.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/data/hash.h"

namespace ddp::nn::data {

namespace {

// The crop window's offset along one side (which: 0 rows, 1 columns), in
// [0, positions). Up to 2^24 positions it is 24 bits of h (bits 0-23 for
// rows, 24-47 for columns) modulo positions, as it always was, so existing
// seeds keep their crops; past 2^24 those bits would leave the offsets from
// 2^24 on unreachable, so a side that long draws 64 bits of its own.
uint64_t CropOffset(uint64_t h, uint64_t which, uint64_t positions) {
  if (positions <= (uint64_t{1} << 24)) return ((h >> (24 * which)) & 0xffffff) % positions;
  return internal::HashOf(h, which) % positions;
}

}  // namespace

TransformOptions FashionMnistNormalize() {
  TransformOptions o;
  o.mean = {0.2860f};
  o.std = {0.3530f};
  return o;
}

TransformOptions Cifar10TrainAugment(uint64_t seed) {
  TransformOptions o;
  o.mean = {0.4914f, 0.4822f, 0.4465f};
  o.std = {0.2470f, 0.2435f, 0.2616f};
  o.random_crop = true;
  o.crop_padding = 4;
  o.horizontal_flip = true;
  o.seed = seed;
  return o;
}

SampleTransform::SampleTransform(ImageShape input, TransformOptions options)
    : input_(input), output_(input), options_(std::move(options)) {
  if (input_.channels <= 0 || input_.height <= 0 || input_.width <= 0) {
    throw std::invalid_argument("SampleTransform: input shape " + input_.ToString() +
                                " must be positive in every dimension");
  }
  const auto& mean = options_.mean;
  const auto& stdv = options_.std;
  if (mean.size() != stdv.size()) {
    throw std::invalid_argument("SampleTransform: normalize has " + std::to_string(mean.size()) +
                                " means but " + std::to_string(stdv.size()) + " stds");
  }
  if (!mean.empty() && mean.size() != 1 && static_cast<int64_t>(mean.size()) != input_.channels) {
    throw std::invalid_argument("SampleTransform: normalize has " + std::to_string(mean.size()) +
                                " values per statistic, the images have " +
                                std::to_string(input_.channels) + " channels");
  }
  // A NaN or infinite statistic turns every pixel of its channel into NaN or
  // 0 without a word, so each is checked; a single value covers all channels.
  for (size_t c = 0; c < mean.size(); ++c) {
    const std::string channel = mean.size() == 1 ? "all channels" : "channel " + std::to_string(c);
    if (!std::isfinite(mean[c])) {
      throw std::invalid_argument("SampleTransform: normalize mean " + std::to_string(mean[c]) +
                                  " for " + channel + " must be finite");
    }
    if (!std::isfinite(stdv[c]) || !(stdv[c] > 0.0f)) {
      throw std::invalid_argument("SampleTransform: normalize std " + std::to_string(stdv[c]) +
                                  " for " + channel + " must be finite and > 0");
    }
  }
  // 0 leaves a crop size unset (the input's); the crop fields mean nothing
  // with the crop off, so setting them there is a mistake, not a no-op.
  if (!options_.random_crop) {
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"crop_height", options_.crop_height},
                                      {"crop_width", options_.crop_width},
                                      {"crop_padding", options_.crop_padding}}) {
      if (value != 0) {
        throw std::invalid_argument(std::string("SampleTransform: ") + name + " " + std::to_string(value) +
                                    " is set but random_crop is off");
      }
    }
  }
  if (options_.random_crop) {
    if (options_.crop_padding < 0) {
      throw std::invalid_argument("SampleTransform: crop_padding " +
                                  std::to_string(options_.crop_padding) + " must be >= 0");
    }
    if (options_.crop_height < 0 || options_.crop_width < 0) {
      throw std::invalid_argument(std::string("SampleTransform: ") +
                                  (options_.crop_height < 0 ? "crop_height " : "crop_width ") +
                                  std::to_string(options_.crop_height < 0 ? options_.crop_height
                                                                          : options_.crop_width) +
                                  " must be >= 0 (0 keeps the input's size)");
    }
    // The padded image's sides; Apply indexes rows and columns of it in int64.
    int64_t both_sides = 0, padded_height = 0, padded_width = 0;
    if (__builtin_mul_overflow(options_.crop_padding, int64_t{2}, &both_sides) ||
        __builtin_add_overflow(input_.height, both_sides, &padded_height) ||
        __builtin_add_overflow(input_.width, both_sides, &padded_width)) {
      throw std::invalid_argument("SampleTransform: crop_padding " + std::to_string(options_.crop_padding) +
                                  " around the input " + input_.ToString() + " overflows int64");
    }
    if (options_.crop_height > 0) output_.height = options_.crop_height;
    if (options_.crop_width > 0) output_.width = options_.crop_width;
    if (output_.height > padded_height || output_.width > padded_width) {
      throw std::invalid_argument(
          "SampleTransform: crop " + std::to_string(output_.height) + "x" +
          std::to_string(output_.width) + " is larger than the padded image " +
          std::to_string(padded_height) + "x" + std::to_string(padded_width));
    }
    // Every batch allocates N x C x crop_height x crop_width: a crop whose
    // one image does not fit in int64 would fail only there, far from the
    // options that caused it.
    int64_t plane = 0, image = 0;
    if (__builtin_mul_overflow(output_.height, output_.width, &plane) ||
        __builtin_mul_overflow(plane, output_.channels, &image)) {
      throw std::invalid_argument("SampleTransform: crop_height " + std::to_string(options_.crop_height) +
                                  " x crop_width " + std::to_string(options_.crop_width) + " (crop_padding " +
                                  std::to_string(options_.crop_padding) + ") gives output images of " +
                                  std::to_string(output_.channels) + "x" + std::to_string(output_.height) + "x" +
                                  std::to_string(output_.width) + " elements, more than int64 holds");
    }
  }
  lut_.resize(input_.channels);
  for (int64_t c = 0; c < input_.channels; ++c) {
    for (int v = 0; v < 256; ++v) {
      float x = static_cast<float>(v) / 255.0f;
      if (!mean.empty()) {
        const size_t k = mean.size() == 1 ? 0 : c;
        x = (x - mean[k]) / stdv[k];
      }
      lut_[c][v] = x;
    }
  }
}

void SampleTransform::Apply(const uint8_t* pixels, float* out, int64_t epoch,
                            int64_t index) const {
  const int64_t ih = input_.height, iw = input_.width;
  const int64_t oh = output_.height, ow = output_.width;
  int64_t top = 0, left = 0;  // window position in padded coordinates
  int64_t pad = 0;
  bool flip = false;
  if (options_.random_crop || options_.horizontal_flip) {
    const uint64_t h = internal::HashOf(options_.seed, 0xa06, static_cast<uint64_t>(epoch),
                                        static_cast<uint64_t>(index));
    if (options_.random_crop) {
      pad = options_.crop_padding;
      top = static_cast<int64_t>(CropOffset(h, 0, static_cast<uint64_t>(ih + 2 * pad - oh + 1)));
      left = static_cast<int64_t>(CropOffset(h, 1, static_cast<uint64_t>(iw + 2 * pad - ow + 1)));
    }
    flip = options_.horizontal_flip && (h >> 63) != 0;
  }
  for (int64_t c = 0; c < input_.channels; ++c) {
    const float* lut = lut_[c].data();
    const uint8_t* src = pixels + c * ih * iw;
    float* dst = out + c * oh * ow;
    for (int64_t y = 0; y < oh; ++y) {
      const int64_t sy = y + top - pad;
      float* row = dst + y * ow;
      if (sy < 0 || sy >= ih) {
        for (int64_t x = 0; x < ow; ++x) row[x] = lut[0];
        continue;
      }
      const uint8_t* srow = src + sy * iw;
      const int64_t shift = left - pad;
      if (!flip && shift == 0 && ow == iw) {
        for (int64_t x = 0; x < ow; ++x) row[x] = lut[srow[x]];
        continue;
      }
      for (int64_t x = 0; x < ow; ++x) {
        const int64_t sx = (flip ? ow - 1 - x : x) + shift;
        row[x] = (sx < 0 || sx >= iw) ? lut[0] : lut[srow[sx]];
      }
    }
  }
}

}  // namespace ddp::nn::data
