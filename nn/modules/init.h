// Parameter initialization, matching PyTorch's formulas (not its random
// streams): a seeded Generator makes runs reproducible.
#pragma once

#include <optional>
#include <string_view>

#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::modules {

/// (fan_in, fan_out) of a weight: [out, in] for linear, [out, in/groups, kh, kw] for conv.
std::pair<int64_t, int64_t> FanInOut(const Tensor& weight);
/// Recommended gain for a nonlinearity, as PyTorch's calculate_gain: 1 for
/// "linear", "sigmoid", "conv1d/2d/3d" and "conv_transpose1d/2d/3d"; 5/3 for
/// "tanh"; sqrt(2) for "relu"; 3/4 for "selu"; sqrt(2 / (1 + slope^2)) for
/// "leaky_relu", where the slope is `param`, 0.01 when not given (an explicit
/// 0 gives sqrt(2), as the Kaiming functions pass their `a`). `param` is
/// ignored for the others.
double Gain(std::string_view nonlinearity, std::optional<double> param = std::nullopt);
/// U(-bound, bound) with bound = gain * sqrt(3 / fan); fan is fan_in or fan_out (mode).
/// Throws std::invalid_argument naming the function (so does KaimingNormal)
/// for another mode, an unknown nonlinearity, a NaN `a` with leaky_relu, or
/// a weight of fewer than 2 dimensions; an empty weight is left as it is.
void KaimingUniform(const Tensor& w, double a, std::string_view mode = "fan_in",
                    std::string_view nonlinearity = "leaky_relu", Generator& gen = DefaultGenerator());
/// N(0, std^2) with std = gain / sqrt(fan).
void KaimingNormal(const Tensor& w, double a = 0.0, std::string_view mode = "fan_in",
                   std::string_view nonlinearity = "leaky_relu", Generator& gen = DefaultGenerator());
/// U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)), as PyTorch's
/// xavier_uniform_ (Glorot): variance gain^2 * 2 / (fan_in + fan_out).
/// Throws std::invalid_argument naming the gain when it is negative or not
/// finite (so does XavierNormal).
void XavierUniform(const Tensor& w, double gain = 1.0, Generator& gen = DefaultGenerator());
/// N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)), as PyTorch's xavier_normal_.
void XavierNormal(const Tensor& w, double gain = 1.0, Generator& gen = DefaultGenerator());
/// U(low, high).
void Uniform(const Tensor& t, double low, double high, Generator& gen = DefaultGenerator());
/// Every element = value.
void Constant(const Tensor& t, double value);

}  // namespace ddp::nn::modules
