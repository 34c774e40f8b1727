#ifndef DDP_DDP_COMM_HOOKS_H_
#define DDP_DDP_COMM_HOOKS_H_

// Communication hooks: how DistributedDataParallel reduces one bucket of
// gradients across ranks (PyTorch's register_comm_hook). The default sums
// the bucket with an all-reduce; the compression hooks send it as 16-bit
// floats, halving the bytes on the wire; users can supply their own.
//
// Contract of a hook: it receives the bucket with this rank's gradients
// already divided by the divisor (the world size, or the ranks still active
// under Join; undivided for CommHook::OnLocalGradients), and must leave in
// bucket.buffer() the sum over all ranks (the average gradient) by the
// time the returned Work completes; local SGD's hooks (NoopHook,
// model_averaging.h) leave a local or subgroup average instead, and
// OverlappedZeroOptimizer's leaves the gradients and updates the
// parameters, on purpose. It is called on the thread running backward, must not block,
// and must issue the same collectives on every rank: run the communication
// through ProcessGroup (Run() executes a function on the communication
// thread, in order with everything else). While the hook runs, a collective
// it issues without a label is labelled with the bucket ("all_reduce bucket
// 3 of 4 parameters `fc2.bias` ... `fc1.weight`(sum, f32 [4106])"), so that
// DDP_DEBUG=detail's desync report and failure messages say which bucket.
// The GradBucket a hook is given stays valid (at the same address) until
// the Work it returned has completed, so a task given to Run() may refer to
// it; DDP lets go of it at the end of backward, once every bucket's Work
// has completed. Its tensors may also be captured by value.

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ddp/process_group.h"
#include "nn/tensor/tensor.h"

namespace ddp::dist {

/// One bucket of gradients, as a hook sees it.
class GradBucket {
 public:
  /// Throws std::invalid_argument, naming the bucket, for a divisor that
  /// is not a positive finite number, an index not below num_buckets, an
  /// undefined parameter, or offsets that do not fit the parameters into
  /// the buffer (one per parameter, each gradient within the buffer).
  GradBucket(size_t index, size_t num_buckets, nn::Tensor buffer, std::vector<nn::Tensor> parameters,
             std::vector<int64_t> offsets, double divisor = 1.0, bool divided = false)
      : index_(index),
        num_buckets_(num_buckets),
        buffer_(std::move(buffer)),
        parameters_(std::move(parameters)),
        offsets_(std::move(offsets)),
        divisor_(divisor),
        divided_(divided),
        buffer_version_(buffer_.defined() ? buffer_.storage()->version() : 0) {
    // A hook divides by it (or multiplies by its inverse): 0, a negative or
    // a non-finite divisor would give infinities or flipped gradients.
    if (!(divisor > 0.0) || !std::isfinite(divisor)) {
      throw std::invalid_argument("GradBucket (bucket " + std::to_string(index) + "): divisor must be a positive "
                                  "finite number (the ranks the gradients are averaged over), got " +
                                  std::to_string(divisor));
    }
    CheckLayout();
  }

  /// Position of the bucket in launch order (0 is launched first).
  size_t index() const { return index_; }
  /// True for the bucket launched last in an iteration.
  bool is_last() const { return index_ + 1 == num_buckets_; }
  /// The flat, contiguous gradients ([numel], one dtype, one device).
  const nn::Tensor& buffer() const { return buffer_; }
  /// The parameters whose gradients the buffer holds, in buffer order.
  const std::vector<nn::Tensor>& parameters() const { return parameters_; }
  /// Element offset of each parameter's gradient in the buffer.
  const std::vector<int64_t>& offsets() const { return offsets_; }
  /// The divisor of this iteration's average: the world size, or under
  /// Join the ranks still active (JoinOptions). The buffer's gradients were
  /// divided by it, unless the hook takes local gradients.
  double divisor() const { return divisor_; }
  /// True when the buffer's gradients were already divided by divisor()
  /// (the reducer does so for every hook not made with
  /// CommHook::OnLocalGradients). A hook that divides them itself
  /// (PowerSgdHook, PostLocalSgdHook) refuses such a bucket: called from
  /// the body of a hook that was given divided gradients, it would divide
  /// twice and leave the gradients divided by the divisor squared.
  bool divided() const { return divided_; }
  /// True when the buffer was written in place (through a tensor
  /// operation, which bumps its storage's version) since the bucket was
  /// made: by the hook it was given to, before that hook called another.
  /// PowerSgdHook and PostLocalSgdHook warn once per state on such a
  /// bucket, as a calling hook on local gradients that divided them itself
  /// would have them divided twice (clipping in place is fine). Writes
  /// through raw pointers are not seen.
  bool buffer_written() const {
    return buffer_.defined() && buffer_.storage()->version() != buffer_version_;
  }

 private:
  // Hooks (PowerSgdHook) read and write each parameter's gradient at its
  // offset in the buffer: a layout that does not fit would have them
  // outside it. And a bucket that is never the last would never count an
  // iteration.
  void CheckLayout() const {
    // Built on a failure only: this runs for every bucket of every backward.
    const auto where = [this] { return "GradBucket (bucket " + std::to_string(index_) + "): "; };
    if (index_ >= num_buckets_) {
      throw std::invalid_argument(where() + "the index is not below the count of buckets, " +
                                  std::to_string(num_buckets_));
    }
    if (parameters_.size() != offsets_.size()) {
      throw std::invalid_argument(where() + std::to_string(parameters_.size()) + " parameters and " +
                                  std::to_string(offsets_.size()) + " offsets; one offset per parameter");
    }
    // Hooks address the buffer as flat memory from its data pointer: a
    // view of another layout (an expanded or strided tensor) would have
    // them past its storage.
    if (buffer_.defined() && (buffer_.dim() != 1 || !buffer_.is_contiguous())) {
      throw std::invalid_argument(where() + "the buffer (" + nn::ShapeToString(buffer_.shape()) +
                                  ") is not one-dimensional and contiguous");
    }
    const int64_t size = buffer_.defined() ? buffer_.numel() : 0;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      const nn::Tensor& p = parameters_[k];
      if (!p.defined()) throw std::invalid_argument(where() + "parameter " + std::to_string(k) + " is undefined");
      const int64_t at = offsets_[k], n = p.numel();
      if (at < 0 || at > size || n > size - at) {
        throw std::invalid_argument(where() + "parameter " + std::to_string(k) + " (" + nn::ShapeToString(p.shape()) +
                                    ", " + std::to_string(n) + " elements) at offset " + std::to_string(at) +
                                    " lies outside the buffer's " + std::to_string(size) + " elements");
      }
    }
  }

  size_t index_;
  size_t num_buckets_;
  nn::Tensor buffer_;
  std::vector<nn::Tensor> parameters_;
  std::vector<int64_t> offsets_;
  double divisor_;
  bool divided_;
  uint64_t buffer_version_;  // the buffer's storage version when handed out
};

/// A communication hook (see the header comment for its contract): any
/// callable Work(ProcessGroup&, GradBucket&).
class CommHook {
 public:
  using Function = std::function<Work(ProcessGroup& group, GradBucket& bucket)>;

  CommHook() = default;
  CommHook(std::nullptr_t) {}  // NOLINT: as std::function
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, CommHook> &&
                                                    std::is_invocable_r_v<Work, F&, ProcessGroup&, GradBucket&>>>
  CommHook(F function) : function_(std::move(function)) {}  // NOLINT: implicit, as std::function

  /// A hook that gets each rank's own gradients, not divided by the
  /// divisor (GradBucket::divisor() still says what it is): it averages
  /// them itself, or keeps them local, and saves the reducer's pass.
  static CommHook OnLocalGradients(Function function) {
    CommHook hook(std::move(function));
    hook.local_gradients_ = true;
    return hook;
  }

  /// This hook with the reducer keeping its first buckets: no rebuild from
  /// the order gradients arrived in, so that a bucket is the same set of
  /// parameters at the same offsets in every iteration (for hooks that keep
  /// state per bucket and its elements, as OverlappedZeroOptimizer's).
  CommHook WithFixedBuckets() const {
    CommHook hook = *this;
    hook.fixed_buckets_ = true;
    return hook;
  }

  /// This hook with the reducer leaving .grad as backward made it: the
  /// hook consumes the bucket (as OverlappedZeroOptimizer's, which steps the
  /// parameters), so nothing reads the reduced gradients from .grad, and
  /// the reducer skips copying buckets back into it after backward (a pass
  /// over every gradient; with gradient_as_bucket_view, and for a gradient
  /// reduced in place, .grad is the bucket regardless).
  CommHook WithoutGradWriteBack() const {
    CommHook hook = *this;
    hook.grad_write_back_ = false;
    return hook;
  }

  Work operator()(ProcessGroup& group, GradBucket& bucket) const { return function_(group, bucket); }
  explicit operator bool() const { return static_cast<bool>(function_); }
  bool on_local_gradients() const { return local_gradients_; }
  bool fixed_buckets() const { return fixed_buckets_; }
  bool grad_write_back() const { return grad_write_back_; }

 private:
  Function function_;
  bool local_gradients_ = false;
  bool fixed_buckets_ = false;
  bool grad_write_back_ = true;
};

namespace hooks {

/// The default: one all-reduce (sum) of the bucket in its own dtype. On an
/// undivided bucket (GradBucket::divided() false: called from the body of
/// a hook made with CommHook::OnLocalGradients) it averages by divisor()
/// instead, as DistributedDataParallel with no hook does: the average
/// either way, as PyTorch's allreduce_hook. An undivided bucket that is not
/// floating throws std::invalid_argument naming the hook, the bucket and
/// its dtype, before anything is sent.
CommHook AllReduceHook();
/// Sends f32/f64 buckets as IEEE f16 (values are divided first, so the
/// sum stays in range: an undivided bucket is divided by divisor() here);
/// 16-bit buckets are reduced as they are. In a group of one process the
/// bucket still goes to f16 and back, so it is rounded as a larger group's
/// is. Leaves the average, as PyTorch's fp16_compress_hook, which however
/// converts first and divides in f16: there a gradient above 65504 is inf
/// whatever the world size, here only when its share, gradient / divisor,
/// is. A bucket that
/// is not floating, divided or not, throws std::invalid_argument naming the
/// hook, the bucket and its dtype, before anything is written or sent.
CommHook Fp16CompressHook();
/// The same with bfloat16: f32's range, 8 bits of mantissa.
CommHook Bf16CompressHook();
/// Sends nothing and leaves the bucket as it was given. Registered itself
/// (it takes local gradients, so nothing is divided) each rank keeps its
/// own gradient, as with PyTorch's noop_hook; called from the body of a
/// hook given divided gradients (GradBucket::divided()), the bucket keeps
/// those, divided by divisor(). For local SGD (with a
/// PeriodicModelAverager, model_averaging.h), or to time DDP without its
/// communication.
CommHook NoopHook();

}  // namespace hooks

namespace internal {

/// How DistributedDataParallel with no hook averages a bucket of `dtype`
/// over a group of `group_size` ranks by `divisor`: inside the all-reduce
/// (op kAvg: sum, then divide; pre_scale 1) when the divisor is the group's
/// size, except in f16; otherwise each rank multiplies its gradients by
/// pre_scale = 1 / divisor and the ranks' parts are summed (op kSum). f16
/// is divided first because the ranks' sum can pass 65504 where no
/// gradient does; under Join the divisor is the active ranks, not the
/// group's size. The one rule shared by the reducer and by every hook that
/// promises the no-hook average (PowerSgdHook before its start,
/// PostLocalSgdHook's global phase, OverlappedZeroOptimizer's hook).
struct NoHookAverage {
  transport::ReduceOp op = transport::ReduceOp::kAvg;
  double pre_scale = 1.0;
};
NoHookAverage PlanNoHookAverage(double divisor, int group_size, nn::DType dtype);

/// Averages `buffer`, this rank's undivided gradients, in place over
/// `group` by `divisor` as DistributedDataParallel with no hook does
/// (PlanNoHookAverage), bit for bit; the returned Work completes with it.
Work AverageAsNoHook(ProcessGroup& group, const nn::Tensor& buffer, double divisor, const std::string& label);

class StateAttachment;

/// Throws std::logic_error naming `hook` and the bucket when
/// bucket.divided(): `hook` divides the gradients itself, so it must be
/// registered as it is, or called from a hook made with
/// CommHook::OnLocalGradients. When the bucket is undivided but
/// bucket.buffer_written() (the calling hook changed the gradients in
/// place: clipped them, scrubbed NaNs, or divided them, which `hook` would
/// then do again), warns once per state (`attachment`'s) on stderr, naming
/// the bucket and that risk, and goes on.
void RequireUndividedBucket(const GradBucket& bucket, const char* hook, StateAttachment& attachment);

/// Tells the copies of one hook apart: each copy of a hook's closure that
/// holds one (the copy a DistributedDataParallel keeps when the hook is
/// registered, say) has a token of its own, which dies with that copy.
class HookCopy {
 public:
  HookCopy() : token_(std::make_shared<const char>('\0')) {}
  HookCopy(const HookCopy&) : HookCopy() {}
  HookCopy(HookCopy&&) noexcept = default;
  HookCopy& operator=(const HookCopy&) {
    token_ = std::make_shared<const char>('\0');
    return *this;
  }
  HookCopy& operator=(HookCopy&&) noexcept = default;
  const std::shared_ptr<const char>& token() const { return token_; }

 private:
  std::shared_ptr<const char> token_;
};

/// The hook copy (and its process group) that a hook's state
/// (PowerSgdState, PostLocalSgdState) serves. A second wrapper, while the
/// hook copy serving the first is alive, would update the state from a
/// second backward thread (and, on another group, a second communication
/// thread), unsynchronized, and count its iterations twice: Attach refuses
/// it. A copy of an attachment is a new one, serving nothing yet.
class StateAttachment {
 public:
  StateAttachment() = default;
  StateAttachment(const StateAttachment&) {}
  StateAttachment& operator=(const StateAttachment&) { return *this; }

  /// Binds the state to the hook copy `copy` (on `group`), or throws
  /// std::logic_error naming the hook, its state's type and `bucket` when
  /// another copy that was called before is still alive (another wrapper,
  /// on this group or another). Once that copy is gone, the state serves
  /// the new one.
  void Attach(const ProcessGroup& group, const HookCopy& copy, const char* hook, const char* state, size_t bucket);

  /// True at the first call only (per attachment, hence per state): the
  /// warning of RequireUndividedBucket is printed once.
  bool FirstWrittenBucketWarning() { return !warned_written_.exchange(true); }

 private:
  std::mutex mu_;
  std::atomic<bool> warned_written_{false};
  const ProcessGroup* serving_ = nullptr;
  std::weak_ptr<const char> serving_hook_;
};

/// dst[i] = src[i] * factor for n elements of one floating dtype
/// (contiguous buffers; 16-bit types computed in f32).
void ScaleCopy(void* dst, const void* src, int64_t n, nn::DType dtype, double factor);
/// dst = src * factor (dst may be src; same shape, dtype and device). CPU
/// tensors take the vectorized loop unless `host_loops` is false; device
/// tensors one kernel of the device's table, on the calling thread's
/// current stream.
void ScaleTensor(const nn::Tensor& dst, const nn::Tensor& src, double factor, bool host_loops = true);
/// f32 -> f16 / bf16 and back, n elements (round to nearest even).
void FloatToHalf(const float* src, uint16_t* dst, int64_t n);
void HalfToFloat(const uint16_t* src, float* dst, int64_t n);
void FloatToBFloat16(const float* src, uint16_t* dst, int64_t n);
void BFloat16ToFloat(const uint16_t* src, float* dst, int64_t n);

}  // namespace internal

}  // namespace ddp::dist

#endif  // DDP_DDP_COMM_HOOKS_H_
