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
#include <set>
#include <thread>
#include <utility>
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
  /// Longest Next() waits for a worker's batch before it throws. Must be
  /// positive; longer than a year counts as a year. With num_workers = 0
  /// there is no deadline: Next() builds the batch itself and returns
  /// when the dataset does, however long that takes.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  /// Longest the destructor waits for a worker still building a batch
  /// (100 ms for one on a batch that made Next() time out). The destructor often runs on the way out with
  /// another error (a peer lost), which must not wait minutes behind a read
  /// from a hung mount. Must be positive.
  std::chrono::milliseconds shutdown_grace{std::chrono::seconds(30)};
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
  /// std::invalid_argument for no dataset, a batch size < 1, negative
  /// workers, a prefetch_factor < 1, a timeout or shutdown grace that is not
  /// positive, or, with drop_last, a batch larger than the sampler's epoch
  /// (no batch at all). The epoch is counted by the sampler's
  /// UnresumedSize(): a DistributedSampler resumed late in one epoch
  /// (set_start) may hold less than a batch there, and that epoch alone is
  /// then empty; the others are whole.
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
             TransformOptions transform, DataLoaderOptions options);
  /// Stops and joins the workers. A batch being built is finished first,
  /// for at most options.shutdown_grace (100 ms once Next() timed out on it):
  /// a worker still inside the dataset then (a read from a hung network
  /// mount) is left running detached, with a warning, so that the error
  /// that brought the caller here gets out instead of a hang.
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Batches per epoch.
  int64_t NumBatches() const;
  /// Shape of one output image.
  ImageShape OutputShape() const;
  const Dataset& dataset() const;
  Sampler& sampler() const { return *sampler_; }

  /// Starts `epoch` (calls the sampler's SetEpoch) at batch `skip_batches`,
  /// which resumes an interrupted epoch exactly; abandons the previous one.
  /// Throws std::out_of_range if the sampler yields an index outside the
  /// dataset. With drop_last, a sampler that has shrunk below one batch
  /// since the constructor checked it (set_start, resuming late in an
  /// epoch) gives an epoch of no batches, as in PyTorch. After a
  /// throw the loader still serves the epoch it had, and the sampler is
  /// set back to the epoch it had before the call (for a sampler whose
  /// epoch() is nullopt: to the loader's epoch, if one was started).
  void StartEpoch(int64_t epoch, int64_t skip_batches = 0);
  /// The next batch of the epoch, or nullopt at its end. Rethrows an error
  /// raised while building the batch; with workers, throws
  /// std::runtime_error after options.timeout without a batch (without
  /// workers it builds the batch itself, with no deadline).
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
  // What the workers use: each holds it, so that one left behind by the
  // destructor (see there) outlives the loader safely.
  struct Shared {
    Shared(std::shared_ptr<const Dataset> d, TransformOptions t, DataLoaderOptions o);

    std::shared_ptr<const Dataset> dataset;
    // Set when the dataset is exactly an InMemoryImageDataset (not a
    // subclass, whose Get may differ): images are read in place instead of
    // through Dataset::Get's copy.
    const InMemoryImageDataset* in_memory = nullptr;
    SampleTransform transform;
    DataLoaderOptions options;

    std::mutex mu;
    std::condition_variable work_cv;   // workers wait for claimable batches
    std::condition_variable ready_cv;  // Next() waits for its batch
    std::condition_variable exit_cv;   // the destructor waits for the workers
    bool stop = false;
    bool started = false;
    Epoch epoch;
    int64_t next_claim = 0;     // next batch a worker may take
    int64_t next_deliver = 0;   // next batch Next() returns
    std::map<int64_t, Result> ready;
    // The error of a batch of this epoch built but not stored in `ready`
    // (out of memory), and which batch; Next() throws it in its place.
    std::exception_ptr unstored;
    int64_t unstored_batch = -1;
    int running = 0;            // workers not yet returned
    std::vector<bool> exited;   // by worker
    // By worker: the batch it is building (-1: none) and its epoch's
    // generation. Then the batches Next() gave up on while a worker was
    // building them, as (generation, batch): one stays listed until that
    // worker returns from it, whatever Next() delivers meanwhile. The
    // destructor gives a worker on an overdue batch 100 ms, the others
    // their full grace.
    std::vector<int64_t> building;
    std::vector<int64_t> building_generation;
    std::set<std::pair<int64_t, int64_t>> overdue;
  };

  static Batch Build(const Shared& s, const Epoch& epoch, int64_t k);
  static void WorkerLoop(const std::shared_ptr<Shared>& s, size_t id);
  // Stops the worker threads (the destructor; a failed constructor).
  void StopWorkers();

  std::shared_ptr<Sampler> sampler_;
  std::shared_ptr<Shared> s_;
  std::vector<std::thread> workers_;
};

namespace internal {
/// For tests only: makes the DataLoader constructors that follow fail to
/// start worker number `worker` (from 0) the way std::thread fails when the
/// system is out of threads. -1 (the default) turns it off.
void FailWorkerStartForTesting(int worker);
}  // namespace internal

}  // namespace ddp::nn::data

#endif  // DDP_NN_DATA_DATA_LOADER_H_
