// A 0-or-1 switch read from the environment, for the CUDA backend's
// settings that a process may flip (DDP_NN_CUDA_BN_SPLIT, DDP_NN_CUDA_VEC).
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ddp::nn::cuda {

/// `fallback` when `name` is unset or empty, else its value: "0" or "1";
/// anything else throws std::invalid_argument naming the variable and value.
inline bool EnvFlag(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  const std::string value = env != nullptr ? env : "";
  if (value.empty()) return fallback;
  if (value == "0" || value == "1") return value == "1";
  throw std::invalid_argument(std::string(name) + "=" + value + " is not 0 or 1");
}

}  // namespace ddp::nn::cuda
