#include "nn/data/data_loader.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace ddp::nn::data {

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
                       TransformOptions transform, DataLoaderOptions options)
    : dataset_(std::move(dataset)),
      sampler_(std::move(sampler)),
      transform_(dataset_ ? dataset_->Shape() : ImageShape{1, 1, 1}, std::move(transform)),
      options_(options) {
  if (!dataset_) throw std::invalid_argument("DataLoader: no dataset");
  if (!sampler_) sampler_ = std::make_shared<SequentialSampler>(dataset_->Size());
  if (options_.batch_size < 1) {
    throw std::invalid_argument("DataLoader: batch_size " + std::to_string(options_.batch_size) +
                                " must be >= 1");
  }
  if (options_.num_workers < 0 || options_.prefetch_factor < 1) {
    throw std::invalid_argument("DataLoader: num_workers " + std::to_string(options_.num_workers) +
                                " must be >= 0 and prefetch_factor " +
                                std::to_string(options_.prefetch_factor) + " >= 1");
  }
  if (options_.drop_last && options_.batch_size > sampler_->Size()) {
    // Every batch would be dropped: an epoch with no step at all.
    throw std::invalid_argument(
        "DataLoader: batch size " + std::to_string(options_.batch_size) + " is larger than the " +
        std::to_string(sampler_->Size()) + " samples this sampler yields per epoch from " +
        dataset_->Name() + "; with drop_last no batch is left (lower the batch size)");
  }
  in_memory_ = dynamic_cast<const InMemoryImageDataset*>(dataset_.get());
  try {
    for (int i = 0; i < options_.num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  } catch (...) {
    // A thread that could not start (out of threads): the destructor does
    // not run for a constructor that throws, and a joinable std::thread
    // destroyed would terminate the process.
    StopWorkers();
    throw;
  }
}

DataLoader::~DataLoader() { StopWorkers(); }

void DataLoader::StopWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

int64_t DataLoader::NumBatches() const {
  const int64_t n = sampler_->Size();
  return options_.drop_last ? n / options_.batch_size
                            : (n + options_.batch_size - 1) / options_.batch_size;
}

void DataLoader::StartEpoch(int64_t epoch, int64_t skip_batches) {
  sampler_->SetEpoch(epoch);
  auto indices = std::make_shared<const std::vector<int64_t>>(sampler_->Indices());
  // The batch count comes from Size(); a sampler whose Indices() disagree
  // would make a batch of negative size or leave indices out.
  if (static_cast<int64_t>(indices->size()) != sampler_->Size()) {
    throw std::logic_error("DataLoader: the sampler's Indices() for epoch " + std::to_string(epoch) +
                           " hold " + std::to_string(indices->size()) + " indices but its Size() is " +
                           std::to_string(sampler_->Size()));
  }
  const int64_t num_batches = NumBatches();
  if (skip_batches < 0 || skip_batches > num_batches) {
    throw std::invalid_argument("DataLoader: cannot skip " + std::to_string(skip_batches) +
                                " batches of an epoch that has " + std::to_string(num_batches));
  }
  for (int64_t i : *indices) {
    if (i < 0 || i >= dataset_->Size()) {
      throw std::out_of_range("DataLoader: sampler index " + std::to_string(i) +
                              " is outside the dataset " + dataset_->Name());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch_.number = epoch;
    ++epoch_.generation;
    epoch_.indices = std::move(indices);
    epoch_.num_batches = num_batches;
    next_claim_ = next_deliver_ = skip_batches;
    // Batches of an abandoned epoch are dropped; workers still building one
    // see the generation change and discard it.
    ready_.clear();
    started_ = true;
  }
  work_cv_.notify_all();
}

Batch DataLoader::Build(const Epoch& epoch, int64_t k) const {
  const int64_t begin = k * options_.batch_size;
  const int64_t end = std::min<int64_t>(begin + options_.batch_size,
                                        static_cast<int64_t>(epoch.indices->size()));
  const int64_t n = end - begin;
  const ImageShape in = dataset_->Shape();
  const ImageShape out = transform_.OutputShape();
  Batch b;
  b.epoch = epoch.number;
  b.index = k;
  b.images = Empty({n, out.channels, out.height, out.width}, {.dtype = DType::kFloat32});
  b.labels = Empty({n}, {.dtype = DType::kInt64});
  float* images = b.images.data<float>();
  int64_t* labels = b.labels.data<int64_t>();
  std::vector<uint8_t> scratch(in_memory_ ? 0 : in.NumPixels());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t index = (*epoch.indices)[begin + i];
    const uint8_t* pixels;
    if (in_memory_) {
      pixels = in_memory_->Pixels(index);
    } else {
      dataset_->Get(index, scratch.data());
      pixels = scratch.data();
    }
    transform_.Apply(pixels, images + i * out.NumPixels(), epoch.number, index);
    labels[i] = dataset_->Label(index);
  }
  return b;
}

void DataLoader::WorkerLoop() {
  const int64_t window = static_cast<int64_t>(options_.num_workers) * options_.prefetch_factor;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] {
      return stop_ || (started_ && next_claim_ < epoch_.num_batches &&
                       next_claim_ < next_deliver_ + window);
    });
    if (stop_) return;
    const int64_t k = next_claim_++;
    const Epoch epoch = epoch_;
    lock.unlock();
    Result r;
    try {
      r.batch = Build(epoch, k);
    } catch (...) {
      r.error = std::current_exception();
    }
    lock.lock();
    if (epoch.generation == epoch_.generation) {
      ready_[k] = std::move(r);
      ready_cv_.notify_all();
    }
  }
}

std::optional<Batch> DataLoader::Next() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!started_) throw std::logic_error("DataLoader: Next() before StartEpoch()");
  if (next_deliver_ >= epoch_.num_batches) return std::nullopt;
  const int64_t k = next_deliver_;
  if (workers_.empty()) {
    ++next_deliver_;
    next_claim_ = next_deliver_;
    const Epoch epoch = epoch_;
    lock.unlock();
    return Build(epoch, k);
  }
  if (!ready_cv_.wait_for(lock, options_.timeout, [&] { return ready_.count(k) > 0; })) {
    throw std::runtime_error("DataLoader: batch " + std::to_string(k) + " of epoch " +
                             std::to_string(epoch_.number) + " not ready after " +
                             std::to_string(options_.timeout.count()) + " ms (" +
                             std::to_string(workers_.size()) + " workers)");
  }
  Result r = std::move(ready_[k]);
  ready_.erase(k);
  ++next_deliver_;
  lock.unlock();
  work_cv_.notify_all();  // the prefetch window moved
  if (r.error) std::rethrow_exception(r.error);
  return std::move(r.batch);
}

}  // namespace ddp::nn::data
