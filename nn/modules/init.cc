#include "nn/modules/init.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace ddp::nn::modules {

std::pair<int64_t, int64_t> FanInOut(const Tensor& w) {
  if (w.dim() < 2) {
    throw std::invalid_argument("fan in/out needs a weight with at least 2 dimensions, got " + ShapeToString(w.shape()));
  }
  int64_t receptive = 1;
  for (int64_t d = 2; d < w.dim(); ++d) receptive *= w.size(d);
  return {w.size(1) * receptive, w.size(0) * receptive};
}

double Gain(std::string_view nonlinearity, std::optional<double> param) {
  for (std::string_view one : {"linear", "sigmoid", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                               "conv_transpose2d", "conv_transpose3d"}) {
    if (nonlinearity == one) return 1.0;
  }
  if (nonlinearity == "tanh") return 5.0 / 3.0;
  if (nonlinearity == "relu") return std::sqrt(2.0);
  if (nonlinearity == "selu") return 3.0 / 4.0;
  if (nonlinearity == "leaky_relu") {
    const double slope = param.value_or(0.01);  // PyTorch's default negative slope
    return std::sqrt(2.0 / (1.0 + slope * slope));
  }
  throw std::invalid_argument("Gain: unknown nonlinearity `" + std::string(nonlinearity) + "`");
}

namespace {
// The gain and the fan both Kaiming forms scale by (each computes its bound
// or deviation from them with the same expression as before, to the bit).
// `caller` prefixes a refused mode, nonlinearity or weight shape, which would
// otherwise name only the helper that found it ("Gain: ...", "fan in/out
// needs ...") and not the function the caller called.
std::pair<double, double> KaimingGainAndFan(const char* caller, const Tensor& w, double a, std::string_view mode,
                                            std::string_view nonlinearity) {
  try {
    const auto [in, out] = FanInOut(w);
    if (mode != "fan_in" && mode != "fan_out") {
      throw std::invalid_argument("mode must be fan_in or fan_out, got `" + std::string(mode) + "`");
    }
    const int64_t fan = mode == "fan_in" ? in : out;
    const double gain = Gain(nonlinearity, a);
    // Only leaky_relu reads `a`; a NaN slope would otherwise be refused by
    // the fill, as bounds or a deviation of NaN, without naming `a`.
    if (std::isnan(gain)) throw std::invalid_argument("a (the negative slope) must not be NaN");
    return {gain, static_cast<double>(fan)};
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(caller) + ": " + e.what());
  }
}
}  // namespace

void KaimingUniform(const Tensor& w, double a, std::string_view mode, std::string_view nonlinearity, Generator& gen) {
  // A tensor with no elements (a layer with 0 inputs: fan 0, an infinite
  // bound) is left as it is, as PyTorch does.
  if (w.numel() == 0) return;
  const auto [gain, fan] = KaimingGainAndFan("KaimingUniform", w, a, mode, nonlinearity);
  const double bound = gain * std::sqrt(3.0 / fan);
  Uniform(w, -bound, bound, gen);
}

void KaimingNormal(const Tensor& w, double a, std::string_view mode, std::string_view nonlinearity, Generator& gen) {
  if (w.numel() == 0) return;  // as KaimingUniform
  const auto [gain, fan] = KaimingGainAndFan("KaimingNormal", w, a, mode, nonlinearity);
  const double std = gain / std::sqrt(fan);
  NoGradGuard guard;
  NormalFill(w, 0.0, std, gen);
}

namespace {
// A value in an error: the fewest significant digits that read back as the
// same double (std::to_string showed a gain of -1e-9 as "-0.000000").
std::string ErrorValue(double v) {
  if (std::isnan(v)) return "nan";
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// gain * sqrt(2 / (fan_in + fan_out)), the standard deviation both Xavier
// forms aim at. `caller` names the form in the refusal of a gain that is
// negative or not finite, which would otherwise fail later as the fill's
// bounds (low above high) or standard deviation, without naming the gain.
double XavierStd(const char* caller, const Tensor& w, double gain) {
  if (!std::isfinite(gain) || gain < 0) {
    throw std::invalid_argument(std::string(caller) + ": gain must be finite and not negative, got " +
                                ErrorValue(gain));
  }
  int64_t in = 0, out = 0;
  try {
    std::tie(in, out) = FanInOut(w);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(caller) + ": " + e.what());  // a weight of fewer than 2 dimensions
  }
  return gain * std::sqrt(2.0 / static_cast<double>(in + out));
}
}  // namespace

void XavierUniform(const Tensor& w, double gain, Generator& gen) {
  // Checked before the empty case: a 1-d tensor has no fans, empty or not.
  const double std = XavierStd("XavierUniform", w, gain);
  if (w.numel() == 0) return;  // nothing to draw (and a fan sum of 0 would divide by 0)
  const double bound = std::sqrt(3.0) * std;
  Uniform(w, -bound, bound, gen);
}

void XavierNormal(const Tensor& w, double gain, Generator& gen) {
  const double std = XavierStd("XavierNormal", w, gain);
  if (w.numel() == 0) return;  // as XavierUniform
  NoGradGuard guard;
  NormalFill(w, 0.0, std, gen);
}

void Uniform(const Tensor& t, double low, double high, Generator& gen) {
  NoGradGuard guard;
  UniformFill(t, low, high, gen);
}

void Constant(const Tensor& t, double value) {
  NoGradGuard guard;
  t.Fill(value);
}

}  // namespace ddp::nn::modules
