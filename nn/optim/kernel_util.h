#ifndef DDP_NN_OPTIM_KERNEL_UTIL_H_
#define DDP_NN_OPTIM_KERNEL_UTIL_H_

// Helpers for the update loops: options become template constants so each
// loop is branch-free and the compiler vectorizes it.

#include <type_traits>

namespace ddp::nn::optim::internal {

/// Calls f(std::true_type) or f(std::false_type).
template <typename F>
void WithFlag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace ddp::nn::optim::internal

#endif  // DDP_NN_OPTIM_KERNEL_UTIL_H_
