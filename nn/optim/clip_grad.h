#ifndef DDP_NN_OPTIM_CLIP_GRAD_H_
#define DDP_NN_OPTIM_CLIP_GRAD_H_

#include <limits>
#include <vector>

#include "nn/tensor/tensor.h"

namespace ddp::nn::optim {

/// Norm type of ClipGradNorm for the maximum norm.
inline constexpr double kInfNorm = std::numeric_limits<double>::infinity();

/// torch.nn.utils.clip_grad_norm_: the norm of all gradients together (as
/// if concatenated; parameters without .grad are ignored), and when it
/// exceeds max_norm every gradient is multiplied by
/// max_norm / (norm + 1e-6). Returns the norm before clipping. A non-finite
/// norm throws std::runtime_error when error_if_nonfinite, otherwise the
/// gradients are scaled by it as PyTorch does (the loss scaler then skips
/// the step). Gradients on a device are reduced there (one host read of the
/// total), the infinity norm included. Gradients may have any strides: a
/// non-contiguous one is read as a contiguous copy, and the clipped values
/// are written back through its strides. Throws std::invalid_argument,
/// changing no gradient, for a gradient of a non-floating dtype or
/// gradients on two devices, naming the parameters' positions in `params`.
double ClipGradNorm(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                    bool error_if_nonfinite = false);

/// torch.nn.utils.clip_grad_value_: every gradient element is clamped to
/// [-clip_value, clip_value] in place (bounds rounded to the gradient's
/// dtype; a NaN element stays NaN, as PyTorch's clamp keeps it); parameters
/// without .grad are skipped. Gradients of f16, bf16, f32 or f64, of any
/// strides, on the CPU or a device whose kernel table has `clamp` (CUDA's,
/// queued on the current stream). Throws std::invalid_argument, changing no
/// gradient, for a negative or NaN clip_value (infinity clips nothing) and
/// for a gradient on a device without that kernel (naming its position and
/// device).
void ClipGradValue(const std::vector<Tensor>& params, double clip_value);

}  // namespace ddp::nn::optim

#endif  // DDP_NN_OPTIM_CLIP_GRAD_H_
