// Parameter initialization, matching PyTorch's formulas (not its random
// streams): a seeded Generator makes runs reproducible.
#pragma once

#include <string_view>

#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::modules {

/// (fan_in, fan_out) of a weight: [out, in] for linear, [out, in/groups, kh, kw] for conv.
std::pair<int64_t, int64_t> FanInOut(const Tensor& weight);
/// Recommended gain for a nonlinearity ("relu", "leaky_relu" with slope a, "linear", "tanh", "sigmoid").
double Gain(std::string_view nonlinearity, double a = 0.0);
/// U(-bound, bound) with bound = gain * sqrt(3 / fan); fan is fan_in or fan_out (mode).
void KaimingUniform(const Tensor& w, double a, std::string_view mode = "fan_in",
                    std::string_view nonlinearity = "leaky_relu", Generator& gen = DefaultGenerator());
/// N(0, std^2) with std = gain / sqrt(fan).
void KaimingNormal(const Tensor& w, double a = 0.0, std::string_view mode = "fan_in",
                   std::string_view nonlinearity = "leaky_relu", Generator& gen = DefaultGenerator());
/// U(low, high).
void Uniform(const Tensor& t, double low, double high, Generator& gen = DefaultGenerator());
/// Every element = value.
void Constant(const Tensor& t, double value);

}  // namespace ddp::nn::modules
