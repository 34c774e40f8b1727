#include "nn/modules/models.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <typeinfo>

#include "nn/modules/init.h"
#include "nn/ops/functional.h"

namespace ddp::nn::modules {

std::shared_ptr<Sequential> MakeMlp(Generator& gen) {
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Flatten>(), std::make_shared<Linear>(784, 512, true, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(512, 256, true, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(256, 10, true, gen)});
}

std::shared_ptr<Sequential> MakeCnn(Generator& gen) {
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 32, 3, Conv2dOptions{}, gen), std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2), std::make_shared<Conv2d>(32, 64, 3, Conv2dOptions{}, gen),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(1600, 128, true, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(128, 10, true, gen)});
}

namespace {

std::shared_ptr<Conv2d> Conv(int64_t in, int64_t out, int64_t k, int64_t stride, Generator& gen) {
  auto c = std::make_shared<Conv2d>(in, out, k, Conv2dOptions{.stride = stride, .padding = k / 2, .bias = false}, gen);
  KaimingNormal(c->weight(), 0.0, "fan_out", "relu", gen);
  return c;
}

// The projection shortcut when the block changes resolution or width (else null).
std::shared_ptr<Sequential> Downsample(int64_t in, int64_t out, int64_t stride, Generator& gen) {
  if (stride == 1 && in == out) return nullptr;
  return std::make_shared<Sequential>(
      std::initializer_list<std::shared_ptr<Module>>{Conv(in, out, 1, stride, gen), std::make_shared<BatchNorm2d>(out)});
}

// A residual block's end, activation(out + identity): with a plain ReLU
// (not one swapped for another module) in one pass over memory, where Add
// and then ReLU would read and write the activation twice.
Tensor AddThenActivate(Module& activation, const Tensor& out, const Tensor& identity) {
  if (typeid(activation) == typeid(ReLU)) return ops::AddRelu(out, identity);
  return activation.Forward(ops::Add(out, identity));
}

}  // namespace

BasicBlock::BasicBlock(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen) {
  RegisterModule("conv1", Conv(in_planes, planes, 3, stride, gen));
  RegisterModule("bn1", std::make_shared<BatchNorm2d>(planes));
  RegisterModule("relu", std::make_shared<ReLU>());
  RegisterModule("conv2", Conv(planes, planes, 3, 1, gen));
  RegisterModule("bn2", std::make_shared<BatchNorm2d>(planes));
  if (auto down = Downsample(in_planes, planes * kExpansion, stride, gen)) RegisterModule("downsample", down);
}

Tensor BasicBlock::Forward(const Tensor& x) {
  // Children are looked up by name so that a replaced one (SyncBatchNorm) is used.
  Tensor out = Child("relu")->Forward(Child("bn1")->Forward(Child("conv1")->Forward(x)));
  out = Child("bn2")->Forward(Child("conv2")->Forward(out));
  const Tensor identity = HasChild("downsample") ? Child("downsample")->Forward(x) : x;
  return AddThenActivate(*Child("relu"), out, identity);
}

Bottleneck::Bottleneck(int64_t in_planes, int64_t planes, int64_t stride, Generator& gen) {
  RegisterModule("conv1", Conv(in_planes, planes, 1, 1, gen));
  RegisterModule("bn1", std::make_shared<BatchNorm2d>(planes));
  RegisterModule("conv2", Conv(planes, planes, 3, stride, gen));
  RegisterModule("bn2", std::make_shared<BatchNorm2d>(planes));
  RegisterModule("conv3", Conv(planes, planes * kExpansion, 1, 1, gen));
  RegisterModule("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
  RegisterModule("relu", std::make_shared<ReLU>());
  if (auto down = Downsample(in_planes, planes * kExpansion, stride, gen)) RegisterModule("downsample", down);
}

Tensor Bottleneck::Forward(const Tensor& x) {
  const auto relu = Child("relu");
  Tensor out = relu->Forward(Child("bn1")->Forward(Child("conv1")->Forward(x)));
  out = relu->Forward(Child("bn2")->Forward(Child("conv2")->Forward(out)));
  out = Child("bn3")->Forward(Child("conv3")->Forward(out));
  const Tensor identity = HasChild("downsample") ? Child("downsample")->Forward(x) : x;
  return AddThenActivate(*relu, out, identity);
}

ResNet::ResNet(bool bottleneck, const std::vector<int64_t>& blocks, ResNetOptions options, Generator& gen)
    : options_(options) {
  // The four widths and fc's input are fixed: another number of stages, or an
  // empty one, builds a model whose fc does not fit its last stage. Checked
  // before anything is drawn from `gen`.
  if (blocks.size() != 4 || std::any_of(blocks.begin(), blocks.end(), [](int64_t b) { return b < 1; })) {
    throw std::invalid_argument("ResNet: blocks " + ShapeToString(blocks) +
                                " must give 4 stages of at least 1 block each");
  }
  // A value cast from an int past the enumerators would otherwise take the
  // CIFAR branch below without anyone asking for it.
  if (options.stem != ResNetStem::kImageNet && options.stem != ResNetStem::kCifar) {
    throw std::invalid_argument("ResNet: stem " + std::to_string(static_cast<int>(options.stem)) +
                                " is not a ResNetStem (0 = kImageNet, 1 = kCifar)");
  }
  const int64_t expansion = bottleneck ? Bottleneck::kExpansion : BasicBlock::kExpansion;
  if (options.stem == ResNetStem::kImageNet) {
    RegisterModule("conv1", Conv(options.in_channels, 64, 7, 2, gen));
  } else {
    RegisterModule("conv1", Conv(options.in_channels, 64, 3, 1, gen));
  }
  RegisterModule("bn1", std::make_shared<BatchNorm2d>(64));
  RegisterModule("relu", std::make_shared<ReLU>());
  if (options.stem == ResNetStem::kImageNet) RegisterModule("maxpool", std::make_shared<MaxPool2d>(3, 2, 1));
  int64_t in_planes = 64;
  const int64_t widths[4] = {64, 128, 256, 512};
  for (size_t stage = 0; stage < 4; ++stage) {
    auto layer = std::make_shared<Sequential>();
    for (int64_t b = 0; b < blocks[stage]; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      if (bottleneck) {
        layer->Push(std::make_shared<Bottleneck>(in_planes, widths[stage], stride, gen));
      } else {
        layer->Push(std::make_shared<BasicBlock>(in_planes, widths[stage], stride, gen));
      }
      in_planes = widths[stage] * expansion;
    }
    RegisterModule("layer" + std::to_string(stage + 1), layer);
  }
  RegisterModule("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  RegisterModule("fc", std::make_shared<Linear>(512 * expansion, options.num_classes, true, gen));
}

Tensor ResNet::Forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& [name, child] : ChildSlots()) {
    if (name == "fc") y = ops::Flatten(y, 1);
    y = child->Forward(y);
  }
  return y;
}

std::shared_ptr<ResNet> MakeResNet18(ResNetOptions options, Generator& gen) {
  return std::make_shared<ResNet>(false, std::vector<int64_t>{2, 2, 2, 2}, options, gen);
}
std::shared_ptr<ResNet> MakeResNet34(ResNetOptions options, Generator& gen) {
  return std::make_shared<ResNet>(false, std::vector<int64_t>{3, 4, 6, 3}, options, gen);
}
std::shared_ptr<ResNet> MakeResNet50(ResNetOptions options, Generator& gen) {
  return std::make_shared<ResNet>(true, std::vector<int64_t>{3, 4, 6, 3}, options, gen);
}

}  // namespace ddp::nn::modules
