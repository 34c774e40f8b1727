// Batch norm on CUDA (the KernelTable's batch_norm entries). Our kernels
// accumulate statistics in f64, as the CPU kernels do, and read and write
// per-channel parameters and statistics in their own dtypes; cuDNN's
// training kernels (when chosen) compute in f32 (BatchNormSavedDType).
#pragma once

#include "nn/tensor/tensor.h"

namespace ddp::nn::cuda {

/// Whether the reductions (training statistics, SyncBatchNorm sums, the
/// backward sums) split each channel over several blocks, as many as fill the
/// GPU (launch::BatchNormSplitParts), instead of one block per channel; with
/// them on, the kernels also read weight, bias, running statistics and saved
/// statistics in their own dtype, in place, instead of through f64 copies
/// (seven small kernels fewer per BatchNorm layer and step). On by default:
/// on an H200 (2026-12-04) it made a ResNet-50 training step on our kernels
/// 1.19x (f32) and 1.35x (bf16) as fast. DDP_NN_CUDA_BN_SPLIT=0 turns it off
/// for a process (any value but 0 or 1 is an error naming it), and tests
/// switch it with the setter.
bool BatchNormSplitReductions();
void SetBatchNormSplitReductions(bool on);

/// Which kernels run training-mode batch norm (forward and backward; eval
/// mode and SyncBatchNorm's building blocks always run ours).
enum class BatchNormKernels : int {
  kOwn = 0,               ///< ours (statistics in f64, as on the CPU)
  kCudnn = 1,             ///< cuDNN's, CUDNN_BATCHNORM_SPATIAL (PyTorch's path for NCHW)
  kCudnnPersistent = 2,   ///< cuDNN's, CUDNN_BATCHNORM_SPATIAL_PERSISTENT
};
/// With cuDNN, statistics come from its f32 arithmetic; per-channel tensors
/// of another dtype than f32 go through f32 copies; an activation dtype that
/// cuDNN declines (not supported, bad parameter) runs on ours from then on,
/// with one line on stderr. kCudnn by default: on an H200 (2026-12-04) a
/// ResNet-50 training step was 1.20x (f32) and 1.41x (bf16) as fast as on
/// our kernels with one block per channel, and about 1.01-1.05x as fast as on
/// our split ones. DDP_NN_CUDA_BN=own, cudnn or cudnn_persistent chooses for
/// a process (any other value is an error naming it), tests switch with the
/// setter.
BatchNormKernels BatchNormKernelChoice();
void SetBatchNormKernels(BatchNormKernels kernels);
/// Whether cuDNN has declined activations of `dt` in the chosen mode in
/// this process (ours have run them since).
bool BatchNormCudnnDeclined(DType dt);

/// f32 where training-mode batch norm of x runs on cuDNN (it computes the
/// statistics in f32), else f64 (ours compute them in f64).
DType BatchNormSavedDType(const Tensor& x, bool training);

void BatchNormForward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                      const Tensor& running_var, bool training, double momentum, double eps, const Tensor& y,
                      const Tensor& save_mean, const Tensor& save_invstd);
void BatchNormBackward(const Tensor& x, const Tensor& dy, const Tensor& weight, const Tensor& save_mean,
                       const Tensor& save_invstd, bool training, double eps, const Tensor& dx,
                       const Tensor& dweight, const Tensor& dbias);
void BatchNormStats(const Tensor& x, const Tensor& sum, const Tensor& sum_sq);
void BatchNormElementwise(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& weight,
                          const Tensor& bias, const Tensor& y);
void BatchNormBackwardReduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                             const Tensor& sum_dy, const Tensor& sum_dy_xhat);
void BatchNormBackwardElementwise(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                  const Tensor& weight, const Tensor& mean_dy, const Tensor& mean_dy_xhat,
                                  const Tensor& dx);

}  // namespace ddp::nn::cuda
