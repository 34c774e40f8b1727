#include "ddp/process_group.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "ddp/debug_mode.h"
#include "ddp/device_ops.h"

namespace ddp::dist {

using transport::Clock;
using transport::Deadline;
using transport::Status;
using std::chrono::milliseconds;

DistributedError::DistributedError(Status status)
    : std::runtime_error(status.ToString()), status_(std::move(status)) {}

transport::DataType ToTransportType(nn::DType dtype) {
  switch (dtype) {
    case nn::DType::kFloat32: return transport::DataType::kF32;
    case nn::DType::kFloat64: return transport::DataType::kF64;
    case nn::DType::kFloat16: return transport::DataType::kF16;
    case nn::DType::kBFloat16: return transport::DataType::kBF16;
    case nn::DType::kInt64: return transport::DataType::kI64;
    case nn::DType::kUInt8: return transport::DataType::kU8;
    case nn::DType::kInt32: return transport::DataType::kI32;
  }
  throw std::invalid_argument("dtype " + std::to_string(static_cast<int>(dtype)) +
                              " has no transport type");
}

std::string CollectiveDescription::ToString() const {
  std::string s = kind + "(";
  if (has_op) s += std::string(transport::ReduceOpName(op)) + ", ";
  if (root >= 0) s += "root " + std::to_string(root) + ", ";
  s += std::string(nn::DTypeName(dtype)) + " " + nn::ShapeToString(shape) + ")";
  return s;
}

// ---------------------------------------------------------------- Work ----

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  Clock::time_point started{};
  Clock::time_point finished{};
  // How long Wait() may block: this call's timeout plus that of every
  // collective queued ahead of it (each one is bounded by its own deadline).
  Clock::duration wait_budget{};
  // Orders device work around the collective (null for CPU tensors).
  std::shared_ptr<internal::DeviceFence> fence;

  void Finish(Status s, Clock::time_point end) {
    {
      std::lock_guard lock(mu);
      status = std::move(s);
      finished = end;
      done = true;
    }
    cv.notify_all();
  }
};

void Work::Wait() {
  if (state_ == nullptr) throw std::logic_error("Work::Wait on an empty handle");
  Status s = WaitFor(Clock::now() + state_->wait_budget);
  if (!s.ok()) throw DistributedError(std::move(s));
  if (state_->fence != nullptr) state_->fence->OrderConsumer();
}

Status Work::WaitFor(Deadline deadline) {
  if (state_ == nullptr) return transport::FailedPreconditionError("WaitFor on an empty Work handle");
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; })) {
    return transport::TimedOutError("collective not finished by the waiter's deadline");
  }
  return state_->status;
}

bool Work::IsCompleted() const {
  if (state_ == nullptr) return false;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

std::chrono::steady_clock::time_point Work::started() const {
  if (state_ == nullptr) return {};
  std::lock_guard lock(state_->mu);
  return state_->started;
}

std::chrono::steady_clock::time_point Work::finished() const {
  if (state_ == nullptr) return {};
  std::lock_guard lock(state_->mu);
  return state_->finished;
}

// ---------------------------------------------------------------- Impl ----

class ProcessGroup::Impl {
 public:
  Impl(std::unique_ptr<transport::Communicator> comm, int rank, int size,
       const ProcessGroupOptions& options)
      : comm_(std::move(comm)), rank_(rank), size_(size), options_(options) {}

  ~Impl() { Stop(); }

  // `fence` orders a collective on device tensors with the caller's stream;
  // null only for host tensors and calls without data (a barrier). No
  // default: a device collective that forgot it raced its producer kernels.
  Work Enqueue(CollectiveDescription description, Task task,
               std::shared_ptr<internal::DeviceFence> fence) {
    auto state = std::make_shared<Work::State>();
    state->fence = std::move(fence);
    Work work(state);
    std::unique_lock lock(mu_);
    if (stopping_) {
      lock.unlock();
      state->Finish(transport::FailedPreconditionError("process group is shutting down"),
                    Clock::now());
      return work;
    }
    state->wait_budget = (queue_.size() + running_ + 1) * options_.timeout + milliseconds(5000);
    queue_.push_back(Item{std::move(description), std::move(task), state});
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { Loop(); });
      pthread_getcpuclockid(thread_.native_handle(), &thread_clock_);
      has_clock_.store(true, std::memory_order_release);
    }
    lock.unlock();
    cv_.notify_one();
    return work;
  }

  void Stop() {
    std::unique_lock lock(mu_);
    if (!thread_.joinable()) return;
    // Let queued collectives finish (a normal program waited for them
    // anyway); if they cannot, the job is broken: abort, so that the peers
    // fail at once instead of at their deadline.
    const Deadline deadline = Clock::now() + std::min<Clock::duration>(options_.timeout,
                                                                       milliseconds(10000));
    if (!idle_cv_.wait_until(lock, deadline, [&] { return queue_.empty() && running_ == 0; })) {
      const size_t pending = queue_.size() + running_;
      lock.unlock();
      Abort(transport::AbortedError("process group of rank " + std::to_string(rank_) +
                                    " destroyed with " + std::to_string(pending) +
                                    " collective(s) unfinished"));
      lock.lock();
    }
    stopping_ = true;
    lock.unlock();
    cv_.notify_all();
    has_clock_.store(false, std::memory_order_release);
    thread_.join();
  }

  void Abort(const Status& reason) {
    if (comm_ != nullptr) {
      comm_->Abort(reason);
      return;
    }
    std::lock_guard lock(abort_mu_);
    if (aborted_.ok()) aborted_ = reason;
  }

  Status aborted_reason() const {
    if (comm_ != nullptr) return comm_->aborted_reason();
    std::lock_guard lock(abort_mu_);
    return aborted_;
  }

  void set_trace(std::shared_ptr<TraceRecorder> trace) {
    std::lock_guard lock(mu_);
    trace_ = std::move(trace);
  }

  std::chrono::nanoseconds CpuTime() const {
    if (!has_clock_.load(std::memory_order_acquire)) return std::chrono::nanoseconds(0);
    timespec ts{};
    if (clock_gettime(thread_clock_, &ts) != 0) return std::chrono::nanoseconds(0);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }

  uint64_t run_count() const { return run_count_.load(std::memory_order_relaxed); }

 private:
  struct Item {
    CollectiveDescription description;
    Task task;
    std::shared_ptr<Work::State> state;
  };

  void Loop() {
    if (options_.comm_thread_nice != 0) {
      // Per-thread on Linux: the thread id names this thread only.
      const int current = getpriority(PRIO_PROCESS, 0);
      setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)),
                  current + options_.comm_thread_nice);
    }
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Item item = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
      std::shared_ptr<TraceRecorder> trace = trace_;
      lock.unlock();

      const Clock::time_point start = Clock::now();
      {
        std::lock_guard state_lock(item.state->mu);
        item.state->started = start;
      }
      const uint64_t sequence = run_count_.fetch_add(1, std::memory_order_relaxed);
      Status status = aborted_reason();
      if (status.ok()) {
        const Deadline deadline = start + options_.timeout;
        try {
          if (options_.debug_detail && comm_ != nullptr && size_ > 1) {
            status = CheckFingerprints(*comm_, rank_, size_, sequence, item.description.ToString(),
                                       deadline);
          }
          internal::DeviceFence* fence = item.state->fence.get();
          if (status.ok() && fence != nullptr) status = fence->WaitReady(deadline);
          if (status.ok()) status = item.task(comm_.get(), deadline);
          if (status.ok() && fence != nullptr) status = fence->MarkDone();
        } catch (const std::exception& e) {
          status = transport::InternalError(item.description.ToString() + " threw: " + e.what());
        }
        if (!status.ok()) Abort(status);
      }
      const Clock::time_point end = Clock::now();
      if (trace != nullptr) {
        trace->Complete(item.description.ToString(), "comm", start, end,
                        "\"ok\": " + std::string(status.ok() ? "true" : "false"));
      }
      item.state->Finish(std::move(status), end);

      lock.lock();
      --running_;
      if (queue_.empty() && running_ == 0) idle_cv_.notify_all();
    }
  }

  std::unique_ptr<transport::Communicator> comm_;
  const int rank_;
  const int size_;
  const ProcessGroupOptions options_;

  std::mutex mu_;
  std::condition_variable cv_;       // the thread waits for work
  std::condition_variable idle_cv_;  // Stop waits for the queue to drain
  std::deque<Item> queue_;
  size_t running_ = 0;
  bool stopping_ = false;
  std::thread thread_;
  std::shared_ptr<TraceRecorder> trace_;
  clockid_t thread_clock_{};
  std::atomic<bool> has_clock_{false};
  std::atomic<uint64_t> run_count_{0};

  mutable std::mutex abort_mu_;
  Status aborted_;  // one-process groups only; otherwise the communicator's
};

// -------------------------------------------------------- ProcessGroup ----

namespace {

ProcessGroupOptions WithEnvironment(ProcessGroupOptions options) {
  if (DebugLevelFromEnvironment() == DebugLevel::kDetail) options.debug_detail = true;
  if (options.timeout.count() <= 0) {
    throw std::invalid_argument("ProcessGroupOptions::timeout must be positive, got " +
                                std::to_string(options.timeout.count()) + " ms");
  }
  return options;
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<transport::Communicator> comm, int rank, int size,
                           ProcessGroupOptions options)
    : rank_(rank), size_(size), options_(WithEnvironment(options)) {
  impl_ = std::make_unique<Impl>(std::move(comm), rank_, size_, options_);
}

ProcessGroup::ProcessGroup(std::unique_ptr<transport::Communicator> comm,
                           ProcessGroupOptions options)
    : ProcessGroup(nullptr, 0, 1, options) {
  if (comm == nullptr) throw std::invalid_argument("ProcessGroup: communicator is null");
  rank_ = comm->rank();
  size_ = comm->size();
  impl_ = std::make_unique<Impl>(std::move(comm), rank_, size_, options_);
}

ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::CreateFromEnvironment(
    ProcessGroupOptions options, transport::CommunicatorOptions comm_options) {
  if (comm_options.timeout == transport::CommunicatorOptions{}.timeout) {
    comm_options.timeout = options.timeout;
  }
  // The caller's thread computes while this group's thread waits in
  // collectives (DDP's backward): two busy threads per rank.
  if (comm_options.busy_threads_per_rank == 0) comm_options.busy_threads_per_rank = 2;
  auto comm = transport::Communicator::CreateFromEnvironment(comm_options);
  if (!comm.ok()) {
    if (comm.status().code() == transport::StatusCode::kNotFound) return Single(options);
    throw DistributedError(comm.status());
  }
  return std::make_shared<ProcessGroup>(std::move(*comm), options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::Single(ProcessGroupOptions options) {
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(nullptr, 0, 1, options));
}

void ProcessGroup::CheckTensor(const nn::Tensor& t, const char* call, const char* what) {
  const std::string where = std::string("ProcessGroup::") + call + ": " + what;
  if (!t.defined()) throw std::invalid_argument(where + " is undefined");
  internal::CheckCollectiveDevice(t.device(), where);
  if (!t.is_contiguous()) {
    throw std::invalid_argument(where + " is not contiguous (shape " + nn::ShapeToString(t.shape()) +
                                ", strides " + nn::ShapeToString(t.strides()) + ")");
  }
}

namespace {

// The fence of a collective on `tensors`: null when they are CPU tensors;
// throws when they are on two devices.
std::shared_ptr<internal::DeviceFence> FenceFor(const std::vector<nn::Tensor>& tensors,
                                                const char* call) {
  const nn::Device device = tensors.at(0).device();
  for (const nn::Tensor& t : tensors) {
    if (t.device() != device) {
      throw std::invalid_argument(std::string("ProcessGroup::") + call + ": tensors on " +
                                  device.ToString() + " and " + t.device().ToString() +
                                  "; one collective uses one device");
    }
  }
  if (device.is_cpu()) return nullptr;
  return internal::MakeFence(device, tensors);
}

// dst = src for a one-process group (the same device for both).
Status LocalCopy(internal::DeviceFence* fence, void* dst, const void* src, size_t bytes) {
  if (fence != nullptr) return fence->CopyOnCommStream(dst, src, bytes);
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  return Status::Ok();
}

}  // namespace

Work ProcessGroup::AllReduce(const nn::Tensor& tensor, transport::ReduceOp op,
                             const std::string& label) {
  CheckTensor(tensor, "AllReduce", "tensor");
  CollectiveDescription d{label.empty() ? "all_reduce" : "all_reduce " + label, tensor.dtype(),
                          tensor.shape(), -1, op, true};
  const transport::DataType type = ToTransportType(tensor.dtype());
  const milliseconds timeout = options_.timeout;
  // The task holds the tensor, so its memory outlives the collective.
  return impl_->Enqueue(std::move(d), [tensor, op, type, timeout](transport::Communicator* comm,
                                                                  Deadline) {
    if (comm == nullptr || tensor.numel() == 0) return Status::Ok();
    return comm->AllReduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, op,
                           {.timeout = timeout});
  }, FenceFor({tensor}, "AllReduce"));
}

Work ProcessGroup::Broadcast(const nn::Tensor& tensor, int root, const std::string& label) {
  CheckTensor(tensor, "Broadcast", "tensor");
  if (root < 0 || root >= size_) {
    throw std::invalid_argument("ProcessGroup::Broadcast: root " + std::to_string(root) +
                                " is outside a group of size " + std::to_string(size_));
  }
  CollectiveDescription d{label.empty() ? "broadcast" : "broadcast " + label, tensor.dtype(),
                          tensor.shape(), root, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(tensor.dtype());
  const milliseconds timeout = options_.timeout;
  return impl_->Enqueue(std::move(d), [tensor, root, type, timeout](transport::Communicator* comm,
                                                                    Deadline) {
    if (comm == nullptr || tensor.numel() == 0) return Status::Ok();
    return comm->Broadcast(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, root,
                           {.timeout = timeout});
  }, FenceFor({tensor}, "Broadcast"));
}

Work ProcessGroup::AllGather(const nn::Tensor& output, const nn::Tensor& input,
                             const std::string& label) {
  CheckTensor(output, "AllGather", "output");
  CheckTensor(input, "AllGather", "input");
  if (output.dtype() != input.dtype() || output.numel() != input.numel() * size_) {
    throw std::invalid_argument(
        "ProcessGroup::AllGather: output must hold size() x input elements of input's dtype: input " +
        std::string(nn::DTypeName(input.dtype())) + " " + nn::ShapeToString(input.shape()) +
        ", output " + std::string(nn::DTypeName(output.dtype())) + " " +
        nn::ShapeToString(output.shape()) + ", size() " + std::to_string(size_));
  }
  CollectiveDescription d{label.empty() ? "all_gather" : "all_gather " + label, input.dtype(),
                          input.shape(), -1, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(input.dtype());
  const milliseconds timeout = options_.timeout;
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({output, input}, "AllGather");
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [output, input, type, timeout, local](
                                          transport::Communicator* comm, Deadline) {
    if (comm == nullptr) return LocalCopy(local, output.data_ptr(), input.data_ptr(), input.nbytes());
    if (input.numel() == 0) return Status::Ok();
    return comm->AllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                           type, {.timeout = timeout});
  }, std::move(fence));
}

Work ProcessGroup::AllToAll(const nn::Tensor& output, const nn::Tensor& input,
                            std::vector<int64_t> output_splits, std::vector<int64_t> input_splits,
                            const std::string& label) {
  CheckTensor(output, "AllToAll", "output");
  CheckTensor(input, "AllToAll", "input");
  const std::string where = "ProcessGroup::AllToAll: ";
  if (output.dim() == 0 || input.dim() == 0 || output.dtype() != input.dtype() ||
      output.numel() * input.size(0) != input.numel() * output.size(0)) {
    throw std::invalid_argument(where + "input and output need rows of one dtype and size: input " +
                                std::string(nn::DTypeName(input.dtype())) + " " +
                                nn::ShapeToString(input.shape()) + ", output " +
                                std::string(nn::DTypeName(output.dtype())) + " " +
                                nn::ShapeToString(output.shape()));
  }
  if (!output.device().is_cpu() || !input.device().is_cpu()) {
    throw std::invalid_argument(where + "takes CPU tensors");
  }
  // Splits in rows, checked against dim 0; then in elements.
  auto resolve = [&](std::vector<int64_t>& splits, const nn::Tensor& t, const char* name) {
    const int64_t rows = t.size(0);
    if (splits.empty()) {
      if (rows % size_ != 0) {
        throw std::invalid_argument(where + name + " has " + std::to_string(rows) +
                                    " rows, not a multiple of size() " + std::to_string(size_) +
                                    "; pass split sizes");
      }
      splits.assign(static_cast<size_t>(size_), rows / size_);
    }
    int64_t total = 0;
    for (int64_t s : splits) {
      if (s < 0) throw std::invalid_argument(where + name + " split size " + std::to_string(s) + " is negative");
      total += s;
    }
    if (static_cast<int>(splits.size()) != size_ || total != rows) {
      throw std::invalid_argument(where + std::to_string(splits.size()) + " " + name +
                                  " split sizes adding up to " + std::to_string(total) + " for " +
                                  std::to_string(rows) + " rows and size() " + std::to_string(size_));
    }
    std::vector<size_t> elements;
    const int64_t row = rows > 0 ? t.numel() / rows : 0;
    for (int64_t s : splits) elements.push_back(static_cast<size_t>(s * row));
    return elements;
  };
  std::vector<size_t> sends = resolve(input_splits, input, "input");
  std::vector<size_t> receives = resolve(output_splits, output, "output");
  CollectiveDescription d{label.empty() ? "all_to_all" : "all_to_all " + label, input.dtype(),
                          {static_cast<int64_t>(size_)}, -1, transport::ReduceOp::kSum, false};
  const transport::DataType type = ToTransportType(input.dtype());
  const milliseconds timeout = options_.timeout;
  return impl_->Enqueue(std::move(d), [output, input, type, timeout, sends, receives](
                                          transport::Communicator* comm, Deadline) {
    if (comm == nullptr) {
      if (input.nbytes() > 0) std::memcpy(output.data_ptr(), input.data_ptr(), input.nbytes());
      return Status::Ok();
    }
    return comm->AllToAllV(input.data_ptr(), sends, output.data_ptr(), receives, type,
                           {.timeout = timeout});
  }, nullptr);
}

Work ProcessGroup::ReduceScatter(const nn::Tensor& output, const nn::Tensor& input,
                                 transport::ReduceOp op, const std::string& label) {
  CheckTensor(output, "ReduceScatter", "output");
  CheckTensor(input, "ReduceScatter", "input");
  if (output.dtype() != input.dtype() || input.numel() != output.numel() * size_) {
    throw std::invalid_argument(
        "ProcessGroup::ReduceScatter: input must hold size() x output elements of output's dtype: "
        "input " + std::string(nn::DTypeName(input.dtype())) + " " +
        nn::ShapeToString(input.shape()) + ", output " +
        std::string(nn::DTypeName(output.dtype())) + " " + nn::ShapeToString(output.shape()) +
        ", size() " + std::to_string(size_));
  }
  CollectiveDescription d{label.empty() ? "reduce_scatter" : "reduce_scatter " + label,
                          input.dtype(), input.shape(), -1, op, true};
  const transport::DataType type = ToTransportType(input.dtype());
  const milliseconds timeout = options_.timeout;
  std::shared_ptr<internal::DeviceFence> fence = FenceFor({output, input}, "ReduceScatter");
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(std::move(d), [output, input, op, type, timeout, local](
                                          transport::Communicator* comm, Deadline) {
    if (comm == nullptr) return LocalCopy(local, output.data_ptr(), input.data_ptr(), input.nbytes());
    if (output.numel() == 0) return Status::Ok();
    return comm->ReduceScatter(input.data_ptr(), output.data_ptr(),
                               static_cast<size_t>(output.numel()), type, op,
                               {.timeout = timeout});
  }, std::move(fence));
}

Work ProcessGroup::Barrier() {
  CollectiveDescription d{"barrier", nn::DType::kUInt8, {0}, -1, transport::ReduceOp::kSum, false};
  const milliseconds timeout = options_.timeout;
  return impl_->Enqueue(std::move(d), [timeout](transport::Communicator* comm, Deadline) {
    if (comm == nullptr) return Status::Ok();
    return comm->Barrier({.timeout = timeout});
  }, nullptr);
}

std::shared_ptr<ProcessGroup> ProcessGroup::NewGroup(const std::vector<int>& ranks) {
  if (ranks.empty()) throw std::invalid_argument("ProcessGroup::NewGroup: the rank list is empty");
  std::vector<bool> seen(static_cast<size_t>(size_), false);
  int64_t digest = 0;  // of the list, so that DDP_DEBUG=detail compares lists
  for (int r : ranks) {
    if (r < 0 || r >= size_ || seen[static_cast<size_t>(r)]) {
      throw std::invalid_argument("ProcessGroup::NewGroup: rank " + std::to_string(r) +
                                  (r >= 0 && r < size_ ? " given twice" : " is not in [0, " +
                                                                              std::to_string(size_) + ")"));
    }
    seen[static_cast<size_t>(r)] = true;
    digest = digest * 31 + r + 1;
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = it != ranks.end();
  const int color = member ? 0 : transport::Communicator::kNoColor;
  const int key = static_cast<int>(it - ranks.begin());
  auto made = std::make_shared<std::unique_ptr<transport::Communicator>>();
  CollectiveDescription d{"new_group", nn::DType::kInt64, {static_cast<int64_t>(ranks.size()), digest},
                          -1, transport::ReduceOp::kSum, false};
  impl_->Enqueue(std::move(d), [color, key, made](transport::Communicator* comm, Deadline deadline) {
    if (comm == nullptr) return Status::Ok();  // one process: the list is {0}
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - transport::Clock::now());
    auto child = comm->Split(color, key, {.timeout = std::max(left, milliseconds(1))});
    if (!child.ok()) return child.status();
    *made = std::move(*child);
    return Status::Ok();
  }, nullptr).Wait();
  if (!member) return nullptr;
  if (*made == nullptr) return Single(options_);
  return std::make_shared<ProcessGroup>(std::move(*made), options_);
}

Work ProcessGroup::Run(const CollectiveDescription& description, Task task,
                       const std::vector<nn::Tensor>& device_tensors) {
  if (!task) throw std::invalid_argument("ProcessGroup::Run: empty task for " + description.kind);
  return RunFenced(
      description,
      [task = std::move(task)](transport::Communicator* comm, Deadline deadline,
                               internal::DeviceFence*) { return task(comm, deadline); },
      device_tensors);
}

Work ProcessGroup::RunFenced(const CollectiveDescription& description, FencedTask task,
                             const std::vector<nn::Tensor>& device_tensors) {
  if (!task) throw std::invalid_argument("ProcessGroup::Run: empty task for " + description.kind);
  std::shared_ptr<internal::DeviceFence> fence;
  if (!device_tensors.empty()) {
    for (const nn::Tensor& t : device_tensors) CheckTensor(t, "Run", "device tensor");
    fence = FenceFor(device_tensors, "Run");
  }
  internal::DeviceFence* local = fence.get();  // owned by the Work, which outlives the task
  return impl_->Enqueue(
      description,
      [task = std::move(task), local](transport::Communicator* comm, Deadline deadline) {
        return task(comm, deadline, local);
      },
      std::move(fence));
}

void ProcessGroup::set_trace(std::shared_ptr<TraceRecorder> trace) {
  impl_->set_trace(std::move(trace));
}

std::chrono::nanoseconds ProcessGroup::CommThreadCpuTime() const { return impl_->CpuTime(); }

uint64_t ProcessGroup::collectives_run() const { return impl_->run_count(); }

Status ProcessGroup::aborted_reason() const { return impl_->aborted_reason(); }

void ProcessGroup::Abort(const Status& reason) { impl_->Abort(reason); }

// ------------------------------------------------------- default group ----

namespace {
std::mutex default_mu;
std::shared_ptr<ProcessGroup>& DefaultSlot() {
  static auto* slot = new std::shared_ptr<ProcessGroup>();
  return *slot;
}
}  // namespace

std::shared_ptr<ProcessGroup> InitProcessGroup(ProcessGroupOptions options,
                                               transport::CommunicatorOptions comm_options) {
  auto group = ProcessGroup::CreateFromEnvironment(options, comm_options);
  SetDefaultProcessGroup(group);
  return group;
}

void SetDefaultProcessGroup(std::shared_ptr<ProcessGroup> group) {
  std::lock_guard lock(default_mu);
  DefaultSlot() = std::move(group);
}

std::shared_ptr<ProcessGroup> DefaultProcessGroup() {
  std::lock_guard lock(default_mu);
  if (DefaultSlot() == nullptr) {
    throw std::logic_error(
        "no default process group: call ddp::dist::InitProcessGroup() first, or pass a group");
  }
  return DefaultSlot();
}

void DestroyProcessGroup() {
  std::shared_ptr<ProcessGroup> old;
  {
    std::lock_guard lock(default_mu);
    old = std::move(DefaultSlot());
    DefaultSlot() = nullptr;
  }
  // `old` is released here, outside the lock (its destructor may wait).
}

}  // namespace ddp::dist
