#include "nn/data/dataset.h"

#include <cstring>
#include <sstream>
#include <utility>

#include "nn/data/hash.h"

namespace ddp::nn::data {

std::string ImageShape::ToString() const {
  std::ostringstream os;
  os << "[" << channels << ", " << height << ", " << width << "]";
  return os.str();
}

InMemoryImageDataset::InMemoryImageDataset(std::string name, ImageShape shape,
                                           int64_t num_classes,
                                           std::vector<uint8_t> pixels,
                                           std::vector<uint8_t> labels)
    : name_(std::move(name)), shape_(shape), num_classes_(num_classes), labels_(std::move(labels)) {
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(pixels));
  pixels_ = owned->data();
  pixel_bytes_ = owned->size();
  pixel_owner_ = std::move(owned);
  Check();
}

InMemoryImageDataset::InMemoryImageDataset(std::string name, ImageShape shape, int64_t num_classes,
                                           std::shared_ptr<const void> owner, const uint8_t* pixels,
                                           size_t pixel_bytes, std::vector<uint8_t> labels)
    : name_(std::move(name)),
      shape_(shape),
      num_classes_(num_classes),
      pixel_owner_(std::move(owner)),
      pixels_(pixels),
      pixel_bytes_(pixel_bytes),
      labels_(std::move(labels)) {
  Check();
}

void InMemoryImageDataset::Check() const {
  if (shape_.channels <= 0 || shape_.height <= 0 || shape_.width <= 0) {
    throw DatasetError(name_ + ": image shape " + shape_.ToString() +
                       " must be positive in every dimension");
  }
  uint64_t expected = 0;
  if (!shape_.PixelsFit() ||
      __builtin_mul_overflow(static_cast<uint64_t>(labels_.size()), static_cast<uint64_t>(shape_.NumPixels()),
                             &expected)) {
    throw DatasetError(name_ + ": image shape " + shape_.ToString() + " times " +
                       std::to_string(labels_.size()) + " labels overflows the pixel count");
  }
  if (num_classes_ <= 0 || num_classes_ > 256) {
    throw DatasetError(name_ + ": number of classes " + std::to_string(num_classes_) +
                       " must be in [1, 256] for u8 labels");
  }
  if (pixel_bytes_ != expected) {
    throw DatasetError(name_ + ": " + std::to_string(labels_.size()) + " labels need " +
                       std::to_string(expected) + " pixel bytes of shape " +
                       shape_.ToString() + ", got " + std::to_string(pixel_bytes_));
  }
  for (size_t i = 0; i < labels_.size(); ++i) {
    if (labels_[i] >= num_classes_) {
      throw DatasetError(name_ + ": label " + std::to_string(labels_[i]) + " of sample " +
                         std::to_string(i) + " is out of range [0, " +
                         std::to_string(num_classes_) + ")");
    }
  }
}

void InMemoryImageDataset::CheckIndex(int64_t index) const {
  if (index < 0 || index >= Size()) {
    throw std::out_of_range(name_ + ": sample index " + std::to_string(index) +
                            " is out of range [0, " + std::to_string(Size()) + ")");
  }
}

const uint8_t* InMemoryImageDataset::Pixels(int64_t index) const {
  CheckIndex(index);
  return pixels_ + index * shape_.NumPixels();
}

void InMemoryImageDataset::Get(int64_t index, uint8_t* pixels) const {
  std::memcpy(pixels, Pixels(index), shape_.NumPixels());
}

int64_t InMemoryImageDataset::Label(int64_t index) const {
  CheckIndex(index);
  return labels_[index];
}

std::string InMemoryImageDataset::Name() const {
  return name_ + " (" + std::to_string(Size()) + " x " + shape_.ToString() + ")";
}

SyntheticDataset::SyntheticDataset(SyntheticOptions options) : options_(options) {
  const ImageShape& s = options_.shape;
  if (s.channels <= 0 || s.height <= 0 || s.width <= 0) {
    throw std::invalid_argument("synthetic dataset: image shape " + s.ToString() +
                                " must be positive in every dimension");
  }
  if (!s.PixelsFit()) {
    throw std::invalid_argument("synthetic dataset: image shape " + s.ToString() +
                                " has more pixels than int64 holds");
  }
  if (options_.size < 0) {
    throw std::invalid_argument("synthetic dataset: size " + std::to_string(options_.size) +
                                " must be >= 0");
  }
  if (options_.num_classes <= 0) {
    throw std::invalid_argument("synthetic dataset: num_classes " +
                                std::to_string(options_.num_classes) + " must be > 0");
  }
}

void SyntheticDataset::CheckIndex(int64_t index) const {
  if (index < 0 || index >= Size()) {
    throw std::out_of_range("synthetic dataset: sample index " + std::to_string(index) +
                            " is out of range [0, " + std::to_string(Size()) + ")");
  }
}

int64_t SyntheticDataset::Label(int64_t index) const {
  CheckIndex(index);
  return static_cast<int64_t>(internal::HashOf(options_.seed, 0x1abe1, index) %
                              static_cast<uint64_t>(options_.num_classes));
}

void SyntheticDataset::Get(int64_t index, uint8_t* pixels) const {
  const int64_t label = Label(index);
  const int64_t n = options_.shape.NumPixels();
  // Eight pixels per hash call for the class template and for the noise;
  // pixel = (3 * template + noise) / 4 keeps the class signal dominant.
  for (int64_t base = 0; base < n; base += 8) {
    uint64_t t = internal::HashOf(options_.seed, 0x7e3, label, base);
    uint64_t r = internal::HashOf(options_.seed, 0x401e, index, base);
    const int64_t end = base + 8 < n ? base + 8 : n;
    for (int64_t p = base; p < end; ++p) {
      const unsigned tv = t & 0xff;
      const unsigned rv = r & 0xff;
      pixels[p] = static_cast<uint8_t>((3 * tv + rv) / 4);
      t >>= 8;
      r >>= 8;
    }
  }
}

std::string SyntheticDataset::Name() const {
  return "synthetic (" + std::to_string(Size()) + " x " + options_.shape.ToString() + ", " +
         std::to_string(options_.num_classes) + " classes, seed " +
         std::to_string(options_.seed) + ")";
}

}  // namespace ddp::nn::data
