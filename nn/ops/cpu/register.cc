#include "nn/ops/cpu/cpu_kernels.h"

namespace ddp::nn::ops::cpu {

KernelTable CpuKernelTable() {
  KernelTable t;
  t.unary = &Unary;
  t.unary_backward = &UnaryBackward;
  t.binary = &Binary;
  t.clamp = &Clamp;
  t.clamp_backward = &ClampBackward;
  t.affine = &Affine;
  t.div_scalar = &DivScalar;
  t.add_scaled_ = &AddScaled;
  t.masked_scale = &MaskedScale;
  t.bernoulli_mask = &BernoulliMask;
  t.sum_to = &SumTo;
  t.argmax = &Argmax;
  t.gemm = &Gemm;
  t.conv2d_forward = &Conv2dForward;
  t.conv2d_backward = &Conv2dBackward;
  t.max_pool2d_forward = &MaxPool2dForward;
  t.max_pool2d_backward = &MaxPool2dBackward;
  t.avg_pool2d_forward = &AvgPool2dForward;
  t.avg_pool2d_backward = &AvgPool2dBackward;
  t.adaptive_avg_pool2d_forward = &AdaptiveAvgPool2dForward;
  t.adaptive_avg_pool2d_backward = &AdaptiveAvgPool2dBackward;
  t.batch_norm_forward = &BatchNormForward;
  t.batch_norm_backward = &BatchNormBackward;
  t.batch_norm_stats = &BatchNormStats;
  t.batch_norm_elementwise = &BatchNormElementwise;
  t.batch_norm_backward_reduce = &BatchNormBackwardReduce;
  t.batch_norm_backward_elementwise = &BatchNormBackwardElementwise;
  t.log_softmax_forward = &LogSoftmaxForward;
  t.log_softmax_backward = &LogSoftmaxBackward;
  t.cross_entropy_forward = &CrossEntropyForward;
  t.cross_entropy_backward = &CrossEntropyBackward;
  t.nll_loss_forward = &NllLossForward;
  t.nll_loss_backward = &NllLossBackward;
  return t;
}

}  // namespace ddp::nn::ops::cpu
