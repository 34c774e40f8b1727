#include "nn/data/data_loader.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <system_error>
#include <typeinfo>
#include <utility>

namespace ddp::nn::data {

namespace {

// Longest wait a DataLoader accepts: longer ones would overflow the clock's
// nanoseconds in a timed wait (milliseconds::max(), "never", fails at once).
constexpr std::chrono::milliseconds kLongestTimeout = std::chrono::hours(24 * 365);

// The worker whose start fails on purpose (tests); -1: none.
std::atomic<int> fail_worker_start{-1};

}  // namespace

void internal::FailWorkerStartForTesting(int worker) { fail_worker_start = worker; }

DataLoader::Shared::Shared(std::shared_ptr<const Dataset> d, TransformOptions t, DataLoaderOptions o)
    : dataset(std::move(d)),
      transform(dataset ? dataset->Shape() : ImageShape{1, 1, 1}, std::move(t)),
      options(o) {}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
                       TransformOptions transform, DataLoaderOptions options)
    : sampler_(std::move(sampler)),
      s_(std::make_shared<Shared>(std::move(dataset), std::move(transform), options)) {
  const Dataset* data = s_->dataset.get();
  DataLoaderOptions& o = s_->options;
  if (data == nullptr) throw std::invalid_argument("DataLoader: no dataset");
  if (!sampler_) sampler_ = std::make_shared<SequentialSampler>(data->Size());
  if (o.batch_size < 1) {
    throw std::invalid_argument("DataLoader: batch_size " + std::to_string(o.batch_size) +
                                " must be >= 1");
  }
  if (o.num_workers < 0 || o.prefetch_factor < 1) {
    throw std::invalid_argument("DataLoader: num_workers " + std::to_string(o.num_workers) +
                                " must be >= 0 and prefetch_factor " +
                                std::to_string(o.prefetch_factor) + " >= 1");
  }
  if (o.timeout.count() <= 0) {
    throw std::invalid_argument("DataLoader: timeout " + std::to_string(o.timeout.count()) +
                                " ms must be positive");
  }
  if (o.shutdown_grace.count() <= 0) {
    throw std::invalid_argument("DataLoader: shutdown_grace " + std::to_string(o.shutdown_grace.count()) +
                                " ms must be positive");
  }
  o.timeout = std::min(o.timeout, kLongestTimeout);
  o.shutdown_grace = std::min(o.shutdown_grace, kLongestTimeout);
  // The sampler's epoch taken whole, through its own virtual count (a
  // subclass's, not its base's): a DistributedSampler's resumed epoch
  // (set_start) may hold less than a batch and is then empty, as in
  // StartEpoch; every other epoch holds UnresumedSize().
  const int64_t epoch_size = sampler_->UnresumedSize();
  if (o.drop_last && o.batch_size > epoch_size) {
    // Every batch would be dropped: an epoch with no step at all.
    const auto* distributed = dynamic_cast<const DistributedSampler*>(sampler_.get());
    const std::string resumed =
        distributed != nullptr && distributed->start() > 0
            ? " (in an epoch taken whole; set_start(" + std::to_string(distributed->start()) + ", " +
                  std::to_string(distributed->start_epoch()) + ") resumes epoch " +
                  std::to_string(distributed->start_epoch()) + " only)"
            : "";
    throw std::invalid_argument(
        "DataLoader: batch size " + std::to_string(o.batch_size) + " is larger than the " +
        std::to_string(epoch_size) + " samples this sampler yields per epoch" + resumed + " from " +
        data->Name() + "; with drop_last no batch is left (lower the batch size)");
  }
  // Only the class itself: a subclass may override Get (remapped indices,
  // altered pixels), and reading Pixels() in place would bypass it.
  if (typeid(*data) == typeid(InMemoryImageDataset)) {
    s_->in_memory = static_cast<const InMemoryImageDataset*>(data);
  }
  s_->exited.assign(static_cast<size_t>(o.num_workers), false);
  s_->building.assign(static_cast<size_t>(o.num_workers), -1);
  s_->building_generation.assign(static_cast<size_t>(o.num_workers), 0);
  try {
    for (int i = 0; i < o.num_workers; ++i) {
      {
        std::lock_guard<std::mutex> lock(s_->mu);
        ++s_->running;
      }
      try {
        if (i == fail_worker_start.load()) {
          throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                                  "DataLoader: worker " + std::to_string(i) +
                                      " not started (a failure injected by a test)");
        }
        workers_.emplace_back([s = s_, id = static_cast<size_t>(i)] { WorkerLoop(s, id); });
      } catch (...) {
        std::lock_guard<std::mutex> lock(s_->mu);
        --s_->running;
        throw;
      }
    }
  } catch (...) {
    // A thread that could not start (out of threads): the destructor does
    // not run for a constructor that throws, and a joinable std::thread
    // destroyed would terminate the process. The workers never started
    // count as exited, or StopWorkers would wait its whole grace for them.
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      for (size_t i = workers_.size(); i < s_->exited.size(); ++i) s_->exited[i] = true;
    }
    StopWorkers();
    throw;
  }
}

DataLoader::~DataLoader() { StopWorkers(); }

ImageShape DataLoader::OutputShape() const { return s_->transform.OutputShape(); }

const Dataset& DataLoader::dataset() const { return *s_->dataset; }

void DataLoader::StopWorkers() {
  std::vector<bool> exited;
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->stop = true;
    s_->work_cv.notify_all();
    // The idle workers return at once; one building a batch has the
    // shutdown grace to finish it, except one on the batch that made
    // Next() time out, which has had its chance already: 100 ms.
    Shared& s = *s_;
    auto on_overdue = [&](size_t i) {
      return s.building[i] >= 0 && s.overdue.count({s.building_generation[i], s.building[i]}) > 0;
    };
    s.exit_cv.wait_for(lock, s.options.shutdown_grace, [&] {
      for (size_t i = 0; i < s.exited.size(); ++i) {
        if (!s.exited[i] && !on_overdue(i)) return false;
      }
      return true;
    });
    if (s.running > 0) {
      s.exit_cv.wait_for(lock, std::min(s.options.shutdown_grace, std::chrono::milliseconds(100)),
                         [&] { return s.running == 0; });
    }
    exited = s.exited;
  }
  size_t left = 0;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (exited[i]) {
      workers_[i].join();  // returning now
    } else {
      workers_[i].detach();  // it holds what it uses (Shared)
      ++left;
    }
  }
  workers_.clear();
  if (left > 0) {
    std::fprintf(stderr,
                 "[ddp] warning: DataLoader: %zu of its workers are still building a batch from %s "
                 "(stuck in the dataset?); left running in the background\n",
                 left, s_->dataset->Name().c_str());
  }
}

int64_t DataLoader::NumBatches() const {
  const int64_t n = sampler_->Size();
  const int64_t bs = s_->options.batch_size;
  // Not (n + bs - 1) / bs: a batch size near INT64_MAX ("all in one") overflows.
  return s_->options.drop_last ? n / bs : n / bs + (n % bs != 0);
}

void DataLoader::StartEpoch(int64_t epoch, int64_t skip_batches) {
  // The sampler's epoch before this call, to set back on failure: its own
  // record if it keeps one (the only one before the first StartEpoch),
  // else the epoch the loader serves.
  std::optional<int64_t> previous = sampler_->epoch();
  if (!previous) {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->started) previous = s_->epoch.number;
  }
  sampler_->SetEpoch(epoch);
  std::shared_ptr<const std::vector<int64_t>> indices;
  int64_t num_batches = 0;
  try {
    indices = std::make_shared<const std::vector<int64_t>>(sampler_->Indices());
    // The batch count comes from Size(); a sampler whose Indices() disagree
    // would make a batch of negative size or leave indices out.
    if (static_cast<int64_t>(indices->size()) != sampler_->Size()) {
      throw std::logic_error("DataLoader: the sampler's Indices() for epoch " + std::to_string(epoch) +
                             " hold " + std::to_string(indices->size()) + " indices but its Size() is " +
                             std::to_string(sampler_->Size()));
    }
    // A sampler that shrank below one batch since the constructor checked
    // it (DistributedSampler::set_start, resuming late in an epoch) gives,
    // with drop_last, an epoch of no batches, as PyTorch's DataLoader does:
    // the samples left are the tail drop_last drops. (This threw, so a job
    // resumed near an epoch's end could not start again.)
    num_batches = NumBatches();
    if (skip_batches < 0 || skip_batches > num_batches) {
      throw std::invalid_argument("DataLoader: cannot skip " + std::to_string(skip_batches) +
                                  " batches of an epoch that has " + std::to_string(num_batches));
    }
    for (int64_t i : *indices) {
      if (i < 0 || i >= s_->dataset->Size()) {
        throw std::out_of_range("DataLoader: sampler index " + std::to_string(i) +
                                " is outside the dataset " + s_->dataset->Name());
      }
    }
  } catch (...) {
    // The loader keeps serving the epoch it had: so must the sampler, or
    // whoever reads it next (a retried StartEpoch, the caller) sees an
    // epoch that never started. A sampler that fails to go back leaves
    // the first error to report.
    if (previous) {
      try {
        sampler_->SetEpoch(*previous);
      } catch (...) {
      }
    }
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    Epoch& e = s_->epoch;
    e.number = epoch;
    ++e.generation;
    e.indices = std::move(indices);
    e.num_batches = num_batches;
    s_->next_claim = s_->next_deliver = skip_batches;
    // Batches of an abandoned epoch are dropped; workers still building one
    // see the generation change and discard it.
    s_->ready.clear();
    s_->unstored = nullptr;
    s_->started = true;
  }
  s_->work_cv.notify_all();
}

Batch DataLoader::Build(const Shared& s, const Epoch& epoch, int64_t k) {
  const int64_t batch_size = s.options.batch_size;
  const int64_t begin = k * batch_size;
  const int64_t size = static_cast<int64_t>(epoch.indices->size());
  const int64_t end = batch_size >= size - begin ? size : begin + batch_size;
  const int64_t n = end - begin;
  const ImageShape in = s.dataset->Shape();
  const ImageShape out = s.transform.OutputShape();
  Batch b;
  b.epoch = epoch.number;
  b.index = k;
  b.images = Empty({n, out.channels, out.height, out.width}, {.dtype = DType::kFloat32});
  b.labels = Empty({n}, {.dtype = DType::kInt64});
  float* images = b.images.data<float>();
  int64_t* labels = b.labels.data<int64_t>();
  std::vector<uint8_t> scratch(s.in_memory ? 0 : in.NumPixels());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t index = (*epoch.indices)[begin + i];
    try {
      const uint8_t* pixels;
      if (s.in_memory) {
        pixels = s.in_memory->Pixels(index);
      } else {
        s.dataset->Get(index, scratch.data());
        pixels = scratch.data();
      }
      s.transform.Apply(pixels, images + i * out.NumPixels(), epoch.number, index);
      labels[i] = s.dataset->Label(index);
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      // Which sample of which batch: the dataset's own message may not say.
      throw DatasetError("DataLoader: " + s.dataset->Name() + " sample " + std::to_string(index) + " (batch " +
                         std::to_string(k) + " of epoch " + std::to_string(epoch.number) + "): " + e.what());
    }
  }
  return b;
}

void DataLoader::WorkerLoop(const std::shared_ptr<Shared>& shared, size_t id) {
  Shared& s = *shared;
  const int64_t window = static_cast<int64_t>(s.options.num_workers) * s.options.prefetch_factor;
  std::unique_lock<std::mutex> lock(s.mu);
  while (true) {
    s.work_cv.wait(lock, [&] {
      return s.stop || (s.started && s.next_claim < s.epoch.num_batches &&
                        s.next_claim < s.next_deliver + window);
    });
    if (s.stop) break;
    const int64_t k = s.next_claim++;
    const Epoch epoch = s.epoch;
    s.building[id] = k;
    s.building_generation[id] = epoch.generation;
    lock.unlock();
    Result r;
    try {
      r.batch = Build(s, epoch, k);
    } catch (...) {
      r.error = std::current_exception();
    }
    lock.lock();
    s.building[id] = -1;
    s.overdue.erase({epoch.generation, k});
    if (epoch.generation == s.epoch.generation) {
      try {
        s.ready[k] = std::move(r);
      } catch (...) {
        // No memory for the map's entry: the batch cannot be handed over.
        // Escaping this thread would end the process; Next() reports it
        // instead, when it reaches batch k. Only the first such failure
        // has a slot: a second batch lost before Next() reads the first
        // makes Next() time out on it.
        if (!s.unstored) {
          s.unstored = std::current_exception();
          s.unstored_batch = k;
        }
      }
      s.ready_cv.notify_all();
    }
  }
  s.exited[id] = true;
  --s.running;
  s.exit_cv.notify_all();
}

std::optional<Batch> DataLoader::Next() {
  Shared& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.started) throw std::logic_error("DataLoader: Next() before StartEpoch()");
  if (s.next_deliver >= s.epoch.num_batches) return std::nullopt;
  const int64_t k = s.next_deliver;
  if (workers_.empty()) {
    ++s.next_deliver;
    s.next_claim = s.next_deliver;
    const Epoch epoch = s.epoch;
    lock.unlock();
    return Build(s, epoch, k);
  }
  const bool arrived = s.ready_cv.wait_for(lock, s.options.timeout, [&] {
    return s.ready.count(k) > 0 || (s.unstored && s.unstored_batch == k);
  });
  if (arrived && s.ready.count(k) == 0) {
    // Built but never stored (see WorkerLoop): an error in its place, as
    // for a batch whose build failed, and the epoch goes on after it.
    const std::exception_ptr error = std::exchange(s.unstored, nullptr);
    const int64_t epoch = s.epoch.number;
    ++s.next_deliver;
    lock.unlock();
    s.work_cv.notify_all();
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      throw std::runtime_error("DataLoader: batch " + std::to_string(k) + " of epoch " + std::to_string(epoch) +
                               " from " + s.dataset->Name() + " was built but could not be handed to Next(): " +
                               e.what());
    }
  }
  if (!arrived) {
    // Only a worker inside batch k now has had its chance. A batch no worker
    // has claimed yet (each busy on another, or on an abandoned epoch's)
    // is not marked: the worker that later takes it is healthy and gets
    // the full shutdown grace.
    for (size_t i = 0; i < s.building.size(); ++i) {
      if (s.building[i] == k && s.building_generation[i] == s.epoch.generation) {
        s.overdue.insert({s.epoch.generation, k});
        break;
      }
    }
    throw std::runtime_error("DataLoader: batch " + std::to_string(k) + " of epoch " +
                             std::to_string(s.epoch.number) + " not ready after " +
                             std::to_string(s.options.timeout.count()) + " ms (" +
                             std::to_string(workers_.size()) + " workers reading " + s.dataset->Name() +
                             ")");
  }
  Result r = std::move(s.ready[k]);
  s.ready.erase(k);
  ++s.next_deliver;
  lock.unlock();
  s.work_cv.notify_all();  // the prefetch window moved
  if (r.error) std::rethrow_exception(r.error);
  return std::move(r.batch);
}

}  // namespace ddp::nn::data
