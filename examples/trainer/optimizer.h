#ifndef DDP_EXAMPLES_TRAINER_OPTIMIZER_H_
#define DDP_EXAMPLES_TRAINER_OPTIMIZER_H_

// The trainer's optimizer from its flags (--optimizer, --lr, --momentum,
// --weight_decay, --decay_norm_and_bias), and the parameter groups it is
// built over.

#include <memory>
#include <vector>

#include "examples/trainer/config.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/optimizer.h"

namespace ddp::examples::trainer {

/// Whether a parameter is one that --decay_norm_and_bias=false spares from
/// weight decay: at most one dimension (a bias, or a BatchNorm or
/// SyncBatchNorm weight or bias: nn has no other normalization layer).
/// Judged on whole parameters, never on a shard's pieces (which are 1-D
/// views of any parameter).
bool IsNormOrBias(const nn::Tensor& param);

/// The groups the optimizer is built over. With decay_norm_and_bias (the
/// default) one group of every parameter, without options: the optimizer is
/// then the plain one of a list, with the state layout it always had.
/// Without it two groups, each in the model's order: group 0 the parameters
/// of two or more dimensions (decayed by --weight_decay), group 1 those of
/// IsNormOrBias with the option "weight_decay" 0.
std::vector<nn::optim::ParamGroup> ParamGroupsOf(const TrainConfig& config,
                                                 nn::optim::NamedParameters params);

/// --optimizer (sgd, adam, adamw, adadelta, rmsprop, adagrad) with --lr,
/// --momentum (sgd's and rmsprop's) and --weight_decay as defaults, the
/// others PyTorch's; throws std::invalid_argument for another name. Over
/// `groups`: one group without options gives the optimizer of a plain list
/// (its parameters), anything else the grouped one. Also the factory of a
/// shard's optimizer under --zero, which passes the groups ParamGroupsOf
/// made with this rank's pieces in them.
std::unique_ptr<nn::optim::Optimizer> MakeOptimizer(const TrainConfig& config,
                                                    std::vector<nn::optim::ParamGroup> groups);

/// The trainer's one learning rate as a scheduler's target: reads group 0's
/// rate and sets every group's to the same value (groups differ only in
/// weight decay). `optimizer` must outlive the target.
nn::optim::LrTarget EveryGroupsRate(nn::optim::Optimizer& optimizer);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_OPTIMIZER_H_
