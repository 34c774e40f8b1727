#ifndef DDP_NN_DATA_DATASET_H_
#define DDP_NN_DATA_DATASET_H_

// Image classification datasets kept as compact as their files: pixels stay
// u8 in memory ([N, C, H, W], channel-major like CIFAR's records) and are
// converted to f32 one batch at a time by the DataLoader. Fashion-MNIST's
// 60000 training images take 47 MB this way instead of 188 MB as f32.

#include <cstdint>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

namespace ddp::nn::data {

/// A dataset file is missing, unreadable or malformed; the message names the
/// file and what was expected.
class DatasetError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Channels, height and width of one image.
struct ImageShape {
  int64_t channels = 0;
  int64_t height = 0;
  int64_t width = 0;

  /// Pixels per image (C*H*W). Unchecked: the datasets reject shapes whose
  /// product overflows int64 (see PixelsFit).
  int64_t NumPixels() const { return channels * height * width; }
  /// True if C*H*W fits in int64.
  bool PixelsFit() const {
    int64_t n = 0;
    return !__builtin_mul_overflow(channels, height, &n) && !__builtin_mul_overflow(n, width, &n);
  }
  /// "[1, 28, 28]".
  std::string ToString() const;
  friend bool operator==(const ImageShape&, const ImageShape&) = default;
};

/// Read-only, random-access image classification dataset. Get and Label are
/// called from several loader threads at once and must be thread-safe.
class Dataset {
 public:
  virtual ~Dataset() = default;

  /// Number of samples.
  virtual int64_t Size() const = 0;
  /// Shape of every image.
  virtual ImageShape Shape() const = 0;
  /// Labels are in [0, NumClasses()).
  virtual int64_t NumClasses() const = 0;
  /// Writes image `index` (0 <= index < Size()) as Shape().NumPixels() u8
  /// values in [C, H, W] order to `pixels`.
  virtual void Get(int64_t index, uint8_t* pixels) const = 0;
  /// Label of sample `index`.
  virtual int64_t Label(int64_t index) const = 0;
  /// Short description for logs: "fashion_mnist/train (60000 x [1, 28, 28])".
  virtual std::string Name() const = 0;
};

/// A dataset held in memory as u8 pixels and u8 labels (what IDX and CIFAR
/// files contain).
class InMemoryImageDataset : public Dataset {
 public:
  /// Takes `pixels` ([N, C, H, W], N = labels.size()) and `labels`, each
  /// label < num_classes. Throws DatasetError naming `name` otherwise.
  InMemoryImageDataset(std::string name, ImageShape shape, int64_t num_classes,
                       std::vector<uint8_t> pixels, std::vector<uint8_t> labels);
  /// The same over `pixel_bytes` bytes at `pixels` that `owner` keeps alive
  /// and unchanged (a mapped file that several processes share).
  InMemoryImageDataset(std::string name, ImageShape shape, int64_t num_classes,
                       std::shared_ptr<const void> owner, const uint8_t* pixels, size_t pixel_bytes,
                       std::vector<uint8_t> labels);

  int64_t Size() const override { return static_cast<int64_t>(labels_.size()); }
  ImageShape Shape() const override { return shape_; }
  int64_t NumClasses() const override { return num_classes_; }
  void Get(int64_t index, uint8_t* pixels) const override;
  int64_t Label(int64_t index) const override;
  std::string Name() const override;

  /// The pixel block of sample `index` (Shape().NumPixels() bytes), no copy.
  const uint8_t* Pixels(int64_t index) const;
  /// Bytes held for pixels and labels.
  int64_t MemoryBytes() const { return static_cast<int64_t>(pixel_bytes_ + labels_.size()); }

 private:
  void CheckIndex(int64_t index) const;
  void Check() const;

  std::string name_;
  ImageShape shape_;
  int64_t num_classes_;
  std::shared_ptr<const void> pixel_owner_;  // a vector, or a mapped file
  const uint8_t* pixels_ = nullptr;
  size_t pixel_bytes_ = 0;
  std::vector<uint8_t> labels_;
};

/// Options of SyntheticDataset.
struct SyntheticOptions {
  int64_t size = 50000;                ///< Number of samples.
  ImageShape shape = {3, 32, 32};      ///< Image shape (CIFAR's by default).
  int64_t num_classes = 10;            ///< Labels are in [0, num_classes).
  uint64_t seed = 0;                   ///< Same seed, same data.
};

/// Images made on demand from (seed, index), so they take no memory and any
/// shape costs the same to hold. Each class has its own random template and
/// every image is its template blended with per-image noise: a model can
/// learn it, which makes timing runs look like training.
class SyntheticDataset : public Dataset {
 public:
  explicit SyntheticDataset(SyntheticOptions options);

  int64_t Size() const override { return options_.size; }
  ImageShape Shape() const override { return options_.shape; }
  int64_t NumClasses() const override { return options_.num_classes; }
  void Get(int64_t index, uint8_t* pixels) const override;
  int64_t Label(int64_t index) const override;
  std::string Name() const override;

 private:
  void CheckIndex(int64_t index) const;

  SyntheticOptions options_;
};

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_DATASET_H_
