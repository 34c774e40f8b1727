// Where a tensor's memory lives. CPU code runs everywhere; CUDA kernels are
// registered by the CUDA library (built under --config=cuda) through the
// backend hooks in allocator.h and the kernel tables in nn/ops/dispatch.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::nn {

/// Kind of device. Values are stable: new kinds are appended only.
enum class DeviceType : int8_t {
  kCPU = 0,
  kCUDA = 1,
};

/// Number of DeviceType values (size of per-device tables).
inline constexpr int kNumDeviceTypes = 2;

/// A device: its kind and, for CUDA, the ordinal (0 for the CPU).
struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}  // NOLINT: implicit

  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device& a, const Device& b) = default;

  /// "cpu" or "cuda:N".
  std::string ToString() const;
  /// Parses "cpu", "cuda" (ordinal 0) or "cuda:N"; throws on anything else.
  static Device Parse(std::string_view text);
};

inline constexpr Device kCPU{DeviceType::kCPU, 0};

}  // namespace ddp::nn
