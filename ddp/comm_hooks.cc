#include "ddp/comm_hooks.h"

#include <immintrin.h>

#include <cstring>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/device_ops.h"
#include "nn/ops/dispatch.h"

namespace ddp::dist {
namespace internal {
namespace {

bool HasF16c() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}

__attribute__((target("avx,f16c"))) void FloatToHalfF16c(const float* src, uint16_t* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = nn::detail::FloatToHalfBits(src[i]);
}

__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src, float* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = nn::detail::HalfBitsToFloat(src[i]);
}

}  // namespace

void FloatToHalf(const float* src, uint16_t* dst, int64_t n) {
  if (HasF16c()) return FloatToHalfF16c(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = nn::detail::FloatToHalfBits(src[i]);
}

void HalfToFloat(const uint16_t* src, float* dst, int64_t n) {
  if (HasF16c()) return HalfToFloatF16c(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = nn::detail::HalfBitsToFloat(src[i]);
}

void FloatToBFloat16(const float* src, uint16_t* dst, int64_t n) {
  // Branch-free on finite values so that the loop vectorizes; NaN keeps a
  // quiet NaN pattern.
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x;
    std::memcpy(&x, src + i, 4);
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    dst[i] = static_cast<uint16_t>(nan ? ((x >> 16) | 0x40u) : rounded);
  }
}

void BFloat16ToFloat(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &x, 4);
  }
}

void ScaleCopy(void* dst, const void* src, int64_t n, nn::DType dtype, double factor) {
  if (factor == 1.0) {
    if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * nn::ElementSize(dtype));
    return;
  }
  DDP_DISPATCH_FLOATING(dtype, "gradient averaging", {
    using A = nn::acc_t<scalar_t>;
    const A f = static_cast<A>(factor);
    const scalar_t* s = static_cast<const scalar_t*>(src);
    scalar_t* d = static_cast<scalar_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<scalar_t>(static_cast<A>(s[i]) * f);
  });
}

void ScaleTensor(const nn::Tensor& dst, const nn::Tensor& src, double factor, bool host_loops) {
  if (host_loops && dst.device().is_cpu() && dst.is_contiguous() && src.is_contiguous()) {
    if (factor == 1.0 && dst.data_ptr() == src.data_ptr()) return;
    ScaleCopy(dst.data_ptr(), src.data_ptr(), dst.numel(), dst.dtype(), factor);
    // Written through a raw pointer: bumped here as the kernel path and
    // CopyFrom do (GradBucket::buffer_written compares versions).
    dst.storage()->BumpVersion();
    return;
  }
  nn::NoGradGuard guard;
  if (factor == 1.0) {
    if (!(dst.storage() == src.storage() && dst.storage_offset() == src.storage_offset())) {
      dst.CopyFrom(src);
    }
    return;
  }
  const auto affine = nn::ops::KernelsFor(dst.device().type).affine;
  if (affine == nullptr) {
    throw std::logic_error("DistributedDataParallel: no affine kernel registered for " +
                           dst.device().ToString() + " (gradient averaging)");
  }
  affine(src, factor, 0.0, dst);
  dst.storage()->BumpVersion();
}

NoHookAverage PlanNoHookAverage(double divisor, int group_size, nn::DType dtype) {
  if (divisor == static_cast<double>(group_size) && dtype != nn::DType::kFloat16) {
    return {transport::ReduceOp::kAvg, 1.0};
  }
  return {transport::ReduceOp::kSum, 1.0 / divisor};
}

Work AverageAsNoHook(ProcessGroup& group, const nn::Tensor& buffer, double divisor, const std::string& label) {
  const NoHookAverage plan = PlanNoHookAverage(divisor, group.size(), buffer.dtype());
  if (plan.pre_scale != 1.0) ScaleTensor(buffer, buffer, plan.pre_scale);
  return group.AllReduce(buffer, plan.op, label);
}

void RequireUndividedBucket(const GradBucket& bucket, const char* hook, StateAttachment& attachment) {
  if (!bucket.divided() && bucket.buffer_written()) {
    // Undivided as handed out, but the calling hook (one on local
    // gradients) wrote the buffer before this call. Clipping or scrubbing
    // NaNs in place is legitimate (PyTorch's hooks take what they are
    // given); dividing would be done twice. The write alone cannot tell
    // them apart, so this warns once rather than failing the step.
    if (attachment.FirstWrittenBucketWarning()) {
      std::ostringstream message;
      message << "warning: " << hook << ": bucket " << bucket.index()
              << "'s buffer was written in place by the calling hook before this call; " << hook
              << " takes this rank's gradients as given and divides them by " << bucket.divisor()
              << " itself, so if the calling hook divided them already they end up divided by "
              << bucket.divisor() * bucket.divisor()
              << " (clipping or scrubbing them in place is fine). Printed once per " << hook << " state\n";
      std::cerr << message.str() << std::flush;
    }
    return;
  }
  if (!bucket.divided()) return;
  std::ostringstream message;
  message << hook << ": bucket " << bucket.index() << " was given already divided by " << bucket.divisor()
          << " (it was called from a hook not made with CommHook::OnLocalGradients), and it divides the "
             "gradients itself: the result would be divided by "
          << bucket.divisor() * bucket.divisor()
          << ". Register it directly, or make the calling hook with CommHook::OnLocalGradients";
  throw std::logic_error(message.str());
}

void StateAttachment::Attach(const ProcessGroup& group, const HookCopy& copy, const char* hook, const char* state,
                             size_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::shared_ptr<const char> serving_hook = serving_hook_.lock();
  if (serving_hook != nullptr && serving_hook != copy.token()) {
    throw std::logic_error(std::string(hook) + " (bucket " + std::to_string(bucket) + ", a group of " +
                           std::to_string(group.size()) + " ranks): its " + state + " already serves " +
                           (serving_ == &group ? "another wrapper on this process group"
                                               : "another process group") +
                           " through a hook that is still alive (another DistributedDataParallel); one state per "
                           "wrapper: give this wrapper its own state, or destroy the other wrapper before reusing "
                           "the state");
  }
  serving_ = &group;
  if (serving_hook != copy.token()) serving_hook_ = copy.token();
}

}  // namespace internal

namespace hooks {
namespace {

enum class Wire { kF16, kBF16 };

// Reduces an f32 or f64 bucket as 16-bit floats on the communication
// thread: compress, all-reduce, decompress into the bucket.
Work CompressedAllReduce(ProcessGroup& group, GradBucket& bucket, Wire wire) {
  const nn::Tensor& buffer = bucket.buffer();
  const nn::DType wire_dtype = wire == Wire::kF16 ? nn::DType::kFloat16 : nn::DType::kBFloat16;
  const nn::DType dtype = buffer.dtype();
  if (dtype == nn::DType::kFloat16 || dtype == nn::DType::kBFloat16) {
    return group.AllReduce(buffer, transport::ReduceOp::kSum,
                           "bucket " + std::to_string(bucket.index()));
  }
  if (dtype != nn::DType::kFloat32 && dtype != nn::DType::kFloat64) {
    throw std::invalid_argument(std::string("compression hook: bucket of dtype ") +
                                std::string(nn::DTypeName(dtype)) + " cannot be compressed");
  }
  CollectiveDescription description{
      std::string(wire == Wire::kF16 ? "fp16" : "bf16") + "_compress bucket " +
          std::to_string(bucket.index()),
      wire_dtype, buffer.shape(), -1, transport::ReduceOp::kSum, true};
  if (!buffer.device().is_cpu()) {
    // On the device: convert on the communication stream (after the
    // bucket's ready event), reduce the 16-bit copy with the device
    // collective, convert back; the Work's completion covers all three.
    const nn::Tensor packed = nn::Empty(buffer.shape(), {.dtype = wire_dtype, .device = buffer.device()});
    const transport::DataType wire_type =
        wire == Wire::kF16 ? transport::DataType::kF16 : transport::DataType::kBF16;
    return group.RunFenced(
        description,
        [buffer, packed, wire_type](transport::Communicator* comm,
                                             transport::Deadline deadline,
                                             internal::DeviceFence* fence) {
          if (buffer.numel() == 0) return transport::Status::Ok();
          transport::Status s = fence->ConvertOnCommStream(packed, buffer, true, deadline);
          if (!s.ok()) return s;
          // One process (no communicator): the round trip alone, so that
          // its gradients are rounded as a group's are.
          if (comm != nullptr) {
            s = comm->AllReduce(packed.data_ptr(), static_cast<size_t>(packed.numel()), wire_type,
                                transport::ReduceOp::kSum, internal::Within(deadline));
            if (!s.ok()) return s;
          }
          // Awaited as well: the bucket is complete when the Work is, also
          // for callers that only WaitFor it (no stream ordering).
          return fence->ConvertOnCommStream(buffer, packed, true, deadline);
        },
        {buffer, packed});
  }
  return group.Run(description, [buffer, wire, wire_dtype, dtype](transport::Communicator* comm,
                                                                  transport::Deadline deadline) {
    const int64_t n = buffer.numel();
    if (n == 0) return transport::Status::Ok();
    // A tensor, not a std::vector: the allocator keeps the block from call
    // to call, and a large one lies in shareable memory when the group's
    // ranks share a host, which the shared-memory engine reduces through
    // mappings (about 3x faster than the cross-memory copies a private
    // buffer needs). Made here, so that only the running call holds one,
    // not every bucket waiting in the queue.
    const nn::Tensor packed_tensor = nn::Empty(buffer.shape(), {.dtype = wire_dtype});
    uint16_t* packed = static_cast<uint16_t*>(packed_tensor.data_ptr());
    if (dtype == nn::DType::kFloat64) {
      // In one rounding: through f32 a value just past the midpoint of two
      // 16-bit neighbours can land on it, and then round the wrong way.
      const double* d = static_cast<const double*>(buffer.data_ptr());
      for (int64_t i = 0; i < n; ++i) {
        packed[i] = wire == Wire::kF16 ? nn::Half(d[i]).bits : nn::BFloat16(d[i]).bits;
      }
    } else if (wire == Wire::kF16) {
      internal::FloatToHalf(static_cast<const float*>(buffer.data_ptr()), packed, n);
    } else {
      internal::FloatToBFloat16(static_cast<const float*>(buffer.data_ptr()), packed, n);
    }
    // One process (no communicator): only the round trip through 16 bits,
    // which a group's gradients go through as well; a one-process baseline
    // then rounds as they do.
    if (comm != nullptr) {
      transport::Status s = comm->AllReduce(
          packed, static_cast<size_t>(n),
          wire == Wire::kF16 ? transport::DataType::kF16 : transport::DataType::kBF16,
          transport::ReduceOp::kSum, internal::Within(deadline));
      if (!s.ok()) return s;
    }
    if (dtype == nn::DType::kFloat64) {
      double* d = static_cast<double*>(buffer.data_ptr());
      for (int64_t i = 0; i < n; ++i) {
        d[i] = wire == Wire::kF16 ? float(nn::Half::FromBits(packed[i])) : float(nn::BFloat16::FromBits(packed[i]));
      }
    } else if (wire == Wire::kF16) {
      internal::HalfToFloat(packed, static_cast<float*>(buffer.data_ptr()), n);
    } else {
      internal::BFloat16ToFloat(packed, static_cast<float*>(buffer.data_ptr()), n);
    }
    return transport::Status::Ok();
  });
}

// The compression hooks take floating buckets only. Checked before
// DivideIfUndivided, whose division of an integer bucket would fail first
// with an error that names neither the hook nor the bucket.
void RequireFloatingBucket(const GradBucket& bucket, const char* hook) {
  const nn::DType dtype = bucket.buffer().dtype();
  if (nn::IsFloating(dtype)) return;
  throw std::invalid_argument(std::string(hook) + ": bucket " + std::to_string(bucket.index()) + " has dtype " +
                              std::string(nn::DTypeName(dtype)) +
                              ", which cannot be compressed (f32 and f64 buckets are sent as 16-bit floats, "
                              "f16 and bf16 ones as they are)");
}

// The compression hooks on an undivided bucket: divided here first, before
// the 16-bit wire (whose sum of undivided gradients may also overflow f16).
void DivideIfUndivided(const GradBucket& bucket) {
  if (bucket.divided() || bucket.divisor() == 1.0) return;
  internal::ScaleTensor(bucket.buffer(), bucket.buffer(), 1.0 / bucket.divisor());
}

}  // namespace

CommHook AllReduceHook() {
  return [](ProcessGroup& group, GradBucket& bucket) {
    const std::string label = "bucket " + std::to_string(bucket.index());
    // Undivided (called from a hook on local gradients): averaged here, as
    // the reducer would have, instead of summed to divisor() times the
    // average.
    if (!bucket.divided()) {
      // Averaging divides: an integer bucket failed inside the division,
      // with an error that named neither this hook nor the bucket.
      const nn::DType dtype = bucket.buffer().dtype();
      if (!nn::IsFloating(dtype)) {
        throw std::invalid_argument("AllReduceHook: bucket " + std::to_string(bucket.index()) + " has dtype " +
                                    std::string(nn::DTypeName(dtype)) +
                                    " and came undivided, so it would be averaged here; only floating buckets "
                                    "can be (a divided one is summed as it is)");
      }
      return internal::AverageAsNoHook(group, bucket.buffer(), bucket.divisor(), label);
    }
    return group.AllReduce(bucket.buffer(), transport::ReduceOp::kSum, label);
  };
}

CommHook Fp16CompressHook() {
  return [](ProcessGroup& group, GradBucket& bucket) {
    RequireFloatingBucket(bucket, "Fp16CompressHook");
    DivideIfUndivided(bucket);
    return CompressedAllReduce(group, bucket, Wire::kF16);
  };
}

CommHook Bf16CompressHook() {
  return [](ProcessGroup& group, GradBucket& bucket) {
    RequireFloatingBucket(bucket, "Bf16CompressHook");
    DivideIfUndivided(bucket);
    return CompressedAllReduce(group, bucket, Wire::kBF16);
  };
}

CommHook NoopHook() {
  // The Work only keeps the bucket in issue order.
  return CommHook::OnLocalGradients([](ProcessGroup& group, GradBucket& bucket) {
    return group.Run({"noop bucket " + std::to_string(bucket.index()), bucket.buffer().dtype(),
                      bucket.buffer().shape(), -1, transport::ReduceOp::kSum, false},
                     [](transport::Communicator*, transport::Deadline) { return transport::Status::Ok(); });
  });
}

}  // namespace hooks
}  // namespace ddp::dist
