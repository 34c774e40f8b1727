// Models. MLP and CNN are exactly the peers' models
// (../shared/peers/README.md), built as Sequential so that their parameter
// names are PyTorch's nn.Sequential names ("1.weight" is the first Linear of
// the MLP, whose child 0 is Flatten). ResNets follow torchvision's
// structure and names (conv1, bn1, layer1.0.conv1, ..., fc) and init
// (kaiming-normal fan_out for convolutions, BatchNorm weight 1, bias 0).
#pragma once

#include <memory>
#include <vector>

#include "nn/modules/layers.h"

namespace ddp::nn::modules {

/// Flatten, Linear(784, 512), ReLU, Linear(512, 256), ReLU, Linear(256, 10).
std::shared_ptr<Sequential> MakeMlp(Generator& gen = DefaultGenerator());

/// Conv2d(1, 32, 3), ReLU, MaxPool2d(2), Conv2d(32, 64, 3), ReLU, MaxPool2d(2),
/// Flatten, Linear(1600, 128), ReLU, Linear(128, 10). Input [N, 1, 28, 28].
std::shared_ptr<Sequential> MakeCnn(Generator& gen = DefaultGenerator());

/// Two 3x3 convolutions with a shortcut (ResNet-18/34).
class BasicBlock : public Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "BasicBlock"; }
};

/// 1x1, 3x3 (strided), 1x1 convolutions with a 4x wider output (ResNet-50).
class Bottleneck : public Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Bottleneck"; }
};

enum class ResNetStem : int8_t {
  kImageNet = 0,  ///< 7x7/2 convolution and 3x3/2 max-pool (224x224 inputs)
  kCifar = 1,     ///< 3x3/1 convolution, no max-pool (32x32 inputs)
};

struct ResNetOptions {
  int64_t num_classes = 1000;
  ResNetStem stem = ResNetStem::kImageNet;
  int64_t in_channels = 3;
};

class ResNet : public Module {
 public:
  /// blocks: BasicBlock or Bottleneck counts per stage, e.g. {2, 2, 2, 2}.
  /// Throws std::invalid_argument unless it gives 4 stages of >= 1 block.
  ResNet(bool bottleneck, const std::vector<int64_t>& blocks, ResNetOptions options, Generator& gen);
  Tensor Forward(const Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "ResNet"; }

 private:
  ResNetOptions options_;
};

std::shared_ptr<ResNet> MakeResNet18(ResNetOptions options = {}, Generator& gen = DefaultGenerator());
std::shared_ptr<ResNet> MakeResNet34(ResNetOptions options = {}, Generator& gen = DefaultGenerator());
std::shared_ptr<ResNet> MakeResNet50(ResNetOptions options = {}, Generator& gen = DefaultGenerator());

}  // namespace ddp::nn::modules
