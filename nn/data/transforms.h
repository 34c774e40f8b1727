#ifndef DDP_NN_DATA_TRANSFORMS_H_
#define DDP_NN_DATA_TRANSFORMS_H_

// Per-sample conversion from a u8 image to f32, with the usual training
// augmentations fused into the one pass over the pixels:
//   random crop with zero padding -> horizontal flip -> scale to [0, 1]
//   -> normalize (x - mean[c]) / std[c]
// the order torchvision's RandomCrop, RandomHorizontalFlip, ToTensor,
// Normalize pipeline gives. Random choices are a pure function of
// (seed, epoch, dataset index): a run is reproducible whatever the number of
// loader threads, and each epoch sees new crops and flips.

#include <array>
#include <cstdint>
#include <vector>

#include "nn/data/dataset.h"

namespace ddp::nn::data {

/// What SampleTransform does; the default is plain scaling to [0, 1].
struct TransformOptions {
  /// Per-channel mean and standard deviation, both empty (no normalization)
  /// or both of size 1 (all channels) or C.
  std::vector<float> mean;
  std::vector<float> std;
  /// Random crop: pad every side with this many zero pixels, then cut a
  /// window of the output size at a random position. 0 with crop off.
  int64_t crop_padding = 0;
  /// Enables the random crop (torchvision's RandomCrop(size, padding)).
  bool random_crop = false;
  /// Output height and width of the crop; 0 keeps the input's.
  int64_t crop_height = 0;
  int64_t crop_width = 0;
  /// Mirror left-right with probability 1/2 (RandomHorizontalFlip()).
  bool horizontal_flip = false;
  /// Seed of the random choices.
  uint64_t seed = 0;
};

/// Fashion-MNIST's usual normalization (mean 0.2860, std 0.3530).
TransformOptions FashionMnistNormalize();
/// CIFAR-10 training augmentation: crop 32 with padding 4, flip, normalize
/// with the per-channel statistics of the training set.
TransformOptions Cifar10TrainAugment(uint64_t seed);

/// Converts u8 images of one shape to normalized, augmented f32 images.
class SampleTransform {
 public:
  /// Throws std::invalid_argument for mismatched mean/std sizes, a mean
  /// that is not finite, a std that is not finite and > 0, a crop larger
  /// than the padded image, negative crop fields, a padding that
  /// overflows, a crop whose C x height x width overflows int64, or crop
  /// fields set with random_crop off.
  SampleTransform(ImageShape input, TransformOptions options);

  /// Shape of the f32 output.
  ImageShape OutputShape() const { return output_; }
  /// Writes image `pixels` (input shape, [C, H, W] u8) to `out` (output
  /// shape, [C, H, W] f32). `epoch` and `index` select the random crop and
  /// flip; the same arguments always give the same result.
  void Apply(const uint8_t* pixels, float* out, int64_t epoch, int64_t index) const;

 private:
  ImageShape input_;
  ImageShape output_;
  TransformOptions options_;
  // lut_[c][v]: the f32 value of u8 value v in channel c after scaling and
  // normalization, computed exactly as (v / 255 - mean) / std in f32.
  std::vector<std::array<float, 256>> lut_;
};

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_TRANSFORMS_H_
