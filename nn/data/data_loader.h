#ifndef DDP_NN_DATA_DATA_LOADER_H_
#define DDP_NN_DATA_DATA_LOADER_H_

// Batches for training: indices from a Sampler, u8 images converted to f32
// by a SampleTransform, assembled into [N, C, H, W] f32 images and [N] i64
// labels. Worker threads (never processes: fork after UCX init is
// forbidden) build the next batches while the caller trains on this one.
//
// A batch's content is a pure function of (sampler indices, batch position,
// epoch, transform seed), so the number of workers never changes results and
// an epoch can be resumed at any batch (StartEpoch's skip_batches).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "nn/data/dataset.h"
#include "nn/data/sampler.h"
#include "nn/data/transforms.h"
#include "nn/tensor/tensor.h"

namespace ddp::nn::data {

/// One batch, on the CPU.
struct Batch {
  Tensor images;       ///< [N, C, H, W] f32.
  Tensor labels;       ///< [N] i64.
  int64_t epoch = 0;   ///< Epoch it belongs to.
  int64_t index = 0;   ///< Position of the batch in its epoch, from 0.
};

/// DataLoader settings, named as PyTorch's where they exist.
struct DataLoaderOptions {
  int64_t batch_size = 64;       ///< Samples per batch (the last may be smaller).
  bool drop_last = false;        ///< Skip a last, smaller batch.
  int num_workers = 0;           ///< Loader threads; 0 builds batches on the caller's thread.
  int prefetch_factor = 2;       ///< Batches built ahead per worker.
  /// Longest Next() waits for one batch before it throws.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

/// Iterates a dataset in batches, epoch by epoch:
///
///   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
///     loader.StartEpoch(epoch);
///     while (auto batch = loader.Next()) Train(batch->images, batch->labels);
///   }
///
/// Not thread-safe: one thread calls StartEpoch and Next.
class DataLoader {
 public:
  /// `sampler` (SequentialSampler when null) must index `dataset`; the
  /// transform is built for the dataset's image shape. Throws
  /// std::invalid_argument for a batch size < 1, negative workers, or, with
  /// drop_last, a batch larger than the sampler's epoch (no batch at all).
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
             TransformOptions transform, DataLoaderOptions options);
  /// Stops and joins the workers (a batch being built is finished first).
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Batches per epoch.
  int64_t NumBatches() const;
  /// Shape of one output image.
  ImageShape OutputShape() const { return transform_.OutputShape(); }
  const Dataset& dataset() const { return *dataset_; }
  Sampler& sampler() const { return *sampler_; }

  /// Starts `epoch` (calls the sampler's SetEpoch) at batch `skip_batches`,
  /// which resumes an interrupted epoch exactly; abandons the previous one.
  /// Throws std::out_of_range if the sampler yields an index outside the
  /// dataset.
  void StartEpoch(int64_t epoch, int64_t skip_batches = 0);
  /// The next batch of the epoch, or nullopt at its end. Rethrows an error
  /// raised while building the batch; throws std::runtime_error after
  /// options.timeout without a batch.
  std::optional<Batch> Next();

 private:
  struct Epoch {
    int64_t number = 0;
    int64_t generation = 0;
    std::shared_ptr<const std::vector<int64_t>> indices;
    int64_t num_batches = 0;
  };
  struct Result {
    Batch batch;
    std::exception_ptr error;
  };

  Batch Build(const Epoch& epoch, int64_t k) const;
  void WorkerLoop();
  // Stops and joins the worker threads (the destructor; a failed constructor).
  void StopWorkers();

  std::shared_ptr<const Dataset> dataset_;
  // Set when the dataset keeps its pixels in memory: images are read in
  // place instead of through Dataset::Get's copy.
  const InMemoryImageDataset* in_memory_ = nullptr;
  std::shared_ptr<Sampler> sampler_;
  SampleTransform transform_;
  DataLoaderOptions options_;

  std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for claimable batches
  std::condition_variable ready_cv_;  // Next() waits for its batch
  bool stop_ = false;
  bool started_ = false;
  Epoch epoch_;
  int64_t next_claim_ = 0;    // next batch a worker may take
  int64_t next_deliver_ = 0;  // next batch Next() returns
  std::map<int64_t, Result> ready_;
  std::vector<std::thread> workers_;
};

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_DATA_LOADER_H_
