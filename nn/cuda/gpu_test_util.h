// Helpers of the gpu-tagged tests that hold CUDA kernels against the CPU's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/ops/dispatch.h"
#include "nn/tensor/generator.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda::testing {

inline const Device kGpu(DeviceType::kCUDA, 0);
inline const ops::KernelTable& Cpu() { return ops::KernelsFor(DeviceType::kCPU); }
inline const ops::KernelTable& Gpu() { return ops::KernelsFor(DeviceType::kCUDA); }

/// Relative and absolute tolerance: |gpu - cpu| <= atol + rtol * |cpu|.
struct Tol {
  double rtol, atol;
};

/// Compares a GPU result with the CPU's element by element, naming the
/// first few mismatches and `what`.
inline void ExpectClose(const Tensor& cpu, const Tensor& gpu, Tol tol, const std::string& what) {
  ASSERT_EQ(cpu.shape(), gpu.shape()) << what;
  const std::vector<double> want = cpu.ToVector<double>();
  const std::vector<double> got = gpu.To(kCPU).ToVector<double>();
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tol.atol + tol.rtol * std::abs(want[i])) && ++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << ": cpu " << want[i] << ", gpu " << got[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements differ";
}

/// A CPU tensor of normal samples in `dt`.
inline Tensor RandnOf(const Shape& shape, DType dt, double mean = 0.0, double stddev = 1.0) {
  Tensor t = Empty(shape);
  NormalFill(t, mean, stddev);
  return t.To(dt);
}

}  // namespace ddp::nn::cuda::testing
