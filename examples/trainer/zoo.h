#ifndef DDP_EXAMPLES_TRAINER_ZOO_H_
#define DDP_EXAMPLES_TRAINER_ZOO_H_

// Models and datasets by name, with the errors a new user meets phrased as
// one line that says how to fix them.

#include <cstdint>
#include <memory>
#include <string>

#include "examples/trainer/config.h"
#include "nn/data/dataset.h"
#include "nn/data/transforms.h"
#include "nn/modules/module.h"

namespace ddp::examples::trainer {

/// The training and test sets of a run and how their images are prepared.
struct Datasets {
  std::shared_ptr<const nn::data::Dataset> train;
  std::shared_ptr<const nn::data::Dataset> test;
  nn::data::TransformOptions train_transform;
  nn::data::TransformOptions test_transform;
  std::string description;  ///< "fashion_mnist (60,000 train / 10,000 test)".
};

/// Image shape the model takes when it is trained on `dataset`: CIFAR's
/// 3x32x32 for ResNets on synthetic data, 1x28x28 for mlp and cnn.
nn::data::ImageShape SyntheticShapeFor(const std::string& model);

/// Loads the datasets of `config` (data_dir resolved; empty means the
/// dataset's usual folder). Throws UsageError for missing or broken files,
/// naming the package or download and --data_dir.
Datasets LoadDatasets(const TrainConfig& config);

/// Builds `config.model` for images of `shape` and `num_classes` classes,
/// initialized from `config.seed`. Throws UsageError for an unknown name or
/// a model that cannot take the images (mlp on CIFAR's 3x32x32).
std::shared_ptr<nn::modules::Module> MakeModel(const TrainConfig& config,
                                               const nn::data::ImageShape& shape,
                                               int64_t num_classes);

/// Parameter count (elements of every parameter).
int64_t CountParameters(const nn::modules::Module& model);

/// Throws UsageError when a rank's share of the training set cannot fill one
/// micro-batch: "--batch_size=N is larger than the M training samples each
/// of the W ranks gets ...".
void CheckBatchFitsShard(const TrainConfig& config, int64_t train_size, int world_size);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_ZOO_H_
