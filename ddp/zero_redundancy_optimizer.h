#ifndef DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_
#define DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_

// An optimizer whose state is sharded across the ranks of a process group
// (ZeRO stage 1, as PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer
// but with DeepSpeed's flat partition). The parameters, laid end to end, are
// cut into one run of about equal length per rank, so a large parameter (an
// embedding, a first layer) may be split between ranks. Each rank keeps
// optimizer state (momentum, Adam's moments, f32 masters of 16-bit
// parameters) for its own elements only, and Step updates only those, then
// each rank broadcasts its updated elements so that every replica stays
// identical. On N ranks a rank holds and updates 1/N of the elements, give
// or take 16 per cut, however uneven the parameters' sizes are.
//
// It runs after DistributedDataParallel has averaged the gradients, so the
// result equals the unsharded optimizer's bit for bit: every update is
// elementwise, each element's owner runs it on the same averaged gradient,
// and the others copy its bytes.
//
//   auto model = ...;
//   DistributedDataParallel ddp(model, {.process_group = pg});
//   ZeroRedundancyOptimizer opt(model->NamedParameters(), pg,
//       [](nn::optim::NamedParameters shard) {
//         return std::make_unique<nn::optim::Adam>(std::move(shard), nn::optim::AdamOptions{.lr = 1e-3});
//       });
//   opt.ZeroGrad(); nn::Backward(loss); opt.Step();
//
// Parameter groups (a group of biases and norms without weight decay, say)
// go to the second constructor, whose factory builds the shard's optimizer
// over the same groups holding this rank's pieces:
//
//   ZeroRedundancyOptimizer opt(groups, pg, [](std::vector<nn::optim::ParamGroup> shard) {
//     return std::make_unique<nn::optim::AdamW>(std::move(shard), nn::optim::AdamWOptions{.lr = 1e-3});
//   });
//   nn::optim::LrScheduler sched(opt.local(), schedule);  // every group from its own rate
//
// Checkpoints: ConsolidatedStateDict gathers the whole state on one rank in
// the unsharded optimizer's format (so a plain optimizer loads it too), and
// LoadStateDict takes such a state on every rank and keeps its own shard.
// A parameter with no elements belongs to no shard, so the consolidated
// state has no entries for it (the unsharded optimizer's may hold its
// "step"): an optimizer that loads it starts that parameter's count
// afresh, which changes no value.
//
// Adding parameters: AddParamGroup (PyTorch's add_param_group), on every
// rank. The new group's parameters are cut among the ranks on their own,
// so the pieces already held and their state stay in place; each rank's
// optimizer takes its pieces of the group as its new last group. Adding a
// group to local() directly is refused at the next Step. A checkpoint
// saved afterwards resumes into an optimizer built over the same groups.
//
// Loss scaling: GradScaler checks only the gradients its optimizer holds,
// which here are one rank's shard, so ranks could disagree on skipping a
// step; use it with the unsharded optimizer.
//
// Uneven inputs: Step broadcasts from every rank, so under
// DistributedDataParallel's Join the ranks that ran out of data must take
// the step too. Hand it to the Join, as PyTorch's Join([model, zero]):
//
//   Join join(ddp, {.shadow_step = [&] { zero.Step(); sched.Step(); }});
//
// A joined rank then gets the active ranks' averaged gradients in its
// .grad at each shadowed backward and steps its shard with them, so the
// result equals the unsharded optimizer's under Join. A learning-rate
// scheduler the active ranks step each iteration must be stepped there
// too (as above): the joined rank's shard otherwise keeps the rate it had
// when it joined, broadcasts parameters stepped with it, and its schedule
// stays behind the others' afterwards. Without the shadow step, the
// active ranks' broadcasts meet a joined rank's Join all-reduce, which
// every rank reports as a desync.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/process_group.h"
#include "nn/optim/optimizer.h"

namespace ddp::dist {

class ZeroRedundancyOptimizer {
 public:
  /// Builds the optimizer of one rank's shard: a 1-D view of each piece of a
  /// parameter the rank owns, named after that parameter, in the order the
  /// parameters were given (possibly empty when there are more ranks than
  /// 16-element runs). Its update must be elementwise, as every optimizer in
  /// nn::optim is; one that looks at a whole tensor (a norm, as LAMB's)
  /// would see only a piece.
  using Factory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(nn::optim::NamedParameters shard)>;

  /// Collective: every rank must construct it with the same parameters
  /// (same names, dtypes, shapes and order; compared across ranks by a
  /// small all-gather) and the same kind of optimizer. Throws
  /// std::invalid_argument on every rank, naming the first parameter that
  /// differs and each rank's, when the lists differ; and for a list that no
  /// optimizer would take (nn::optim::CheckParameters), a null group or
  /// factory, or a factory whose optimizer does not hold exactly the pieces
  /// it was given, in their order and under their names (one built from
  /// the model, or one that renamed them). The shard
  /// optimizers' kind, rates and options are compared across ranks too
  /// (every rank throws, naming the first that differs).
  ZeroRedundancyOptimizer(nn::optim::NamedParameters params, std::shared_ptr<ProcessGroup> pg,
                          const Factory& make);

  /// Builds the optimizer of one rank's shard over parameter groups: one
  /// group per group given at construction, in order and with its options,
  /// holding the pieces of that group's parameters the rank owns (a group
  /// may be empty on a rank, or everywhere).
  using GroupFactory =
      std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<nn::optim::ParamGroup> shard)>;

  /// Parameter groups (PyTorch's param_groups: a group of biases and norms
  /// without weight decay, a layer with its own rate). The parameters are
  /// the groups' lists one after another, partitioned as one list, so a
  /// piece never mixes groups. Collective, as the constructor above; the
  /// ranks must also agree on each parameter's group and on every group's
  /// options (compared across ranks, refused naming the first difference).
  /// Throws std::invalid_argument as above, and when the factory's optimizer
  /// does not have the groups it was given, each with its pieces in order.
  ZeroRedundancyOptimizer(std::vector<nn::optim::ParamGroup> groups, std::shared_ptr<ProcessGroup> pg,
                          const GroupFactory& make);

  /// Updates this rank's shard from its gradients, then broadcasts every
  /// rank's shard from that rank. Collective. Throws DistributedError when a
  /// broadcast fails, std::logic_error naming a parameter that got new
  /// memory (Module::To, or SetData with other elements) after
  /// construction: build the optimizer after moving or converting the
  /// model; and std::invalid_argument naming a gradient not of its
  /// parameter's shape, device or dtype (checked on every rank for every
  /// parameter; the unsharded optimizer would convert a floating gradient
  /// of another dtype). A refused step changes no parameter, and fails the
  /// other ranks too (the group is aborted). Any failure of this rank's
  /// part (out of memory, an exception of any type from the optimizer)
  /// aborts the group alike before it reaches the caller as it came.
  void Step();
  /// Appends a param group (PyTorch's add_param_group: layers unfrozen
  /// while fine-tuning, say). Collective: every rank must add the same
  /// group (its parameters' names, dtypes, shapes and order, and its
  /// options, compared across ranks). Its parameters are cut among the
  /// ranks on their own, as Partition cuts a list, so the pieces of the
  /// parameters already held, and their state, stay where they are; each
  /// rank's optimizer takes its pieces of them as its new last group
  /// (Optimizer::AddParamGroup: options the group lacks take the
  /// optimizer's defaults), and they start with no state. Throws
  /// std::invalid_argument on every rank, naming the first difference, when
  /// the ranks' groups differ, and naming the rank and the reason when one
  /// rank refuses the group (a parameter already held, an unknown option,
  /// an LrScheduler over local(): add groups before making it). Where the
  /// group was added on some ranks only, the optimizer is no longer usable:
  /// its other members then throw std::logic_error, and so does a later
  /// AddParamGroup on every rank, at once.
  void AddParamGroup(nn::optim::ParamGroup group);
  /// Clears every parameter's gradient (the shard's and the others'):
  /// undefined by default, as PyTorch 2.x (1.13 zeroes them), or zeros.
  void ZeroGrad(bool set_to_none = true);

  /// The rate of group 0 (the only one for an optimizer made from a list).
  double lr() const { return local_->lr(); }
  /// Sets the rate of this rank's shard; schedulers run on every rank.
  /// With several groups this throws std::logic_error, as
  /// Optimizer::set_lr does: set each group's (an LrScheduler over local()
  /// drives every group from its own base rate).
  void set_lr(double lr) { local_->set_lr(lr); }
  size_t num_groups() const { return local_->num_groups(); }
  double lr(size_t group) const { return local_->lr(group); }
  void set_lr(size_t group, double lr) { local_->set_lr(group, lr); }

  /// One rank's piece of one parameter: elements [offset, offset + length)
  /// of parameter `param` (its index in construction order), counted in the
  /// parameter's row-major order.
  struct Slice {
    size_t param = 0;
    int64_t offset = 0;
    int64_t length = 0;
    bool operator==(const Slice&) const = default;
  };
  /// The pieces rank r owns, in parameter order. Throws std::out_of_range
  /// for a rank outside the group.
  const std::vector<Slice>& shard(int r) const;
  /// This rank's optimizer (over its shard).
  nn::optim::Optimizer& local() { return *local_; }
  const nn::optim::Optimizer& local() const { return *local_; }

  /// Collective: the whole optimizer's state, as the unsharded optimizer's
  /// StateDict would give it (CPU tensors), on rank `to`; an empty list on
  /// the other ranks. Every rank must pass the same `to`: ranks that differ,
  /// or a `to` outside the group, throw std::invalid_argument on every rank
  /// at once, naming the values, before any state is sent. A rank that
  /// fails on its way (its state dict, or no memory for a peer's state as
  /// it arrives; any exception type) aborts the group, so that the others
  /// fail at once with DistributedError naming it, and rethrows its
  /// exception as it came.
  nn::optim::NamedTensors ConsolidatedStateDict(int to = 0);
  /// Collective: loads a whole state (ConsolidatedStateDict's, or a plain
  /// optimizer's StateDict); each rank keeps the entries of the parameters
  /// it owns. A key naming no parameter, a trained parameter missing from a
  /// state that lists every parameter (see ShardOf), or an entry the shard's
  /// optimizer refuses, fails on every rank (std::invalid_argument naming it on the
  /// rank that found it, naming that rank and its reason on the others:
  /// "failed on rank 1: state entry ..."; ranks with the same reason are
  /// named together, each reason is cut to about 1 KB and at most 8 are
  /// listed), and then no rank
  /// loads anything: every shard is checked before any is loaded. Any
  /// other failure of a rank's check (std::bad_alloc, say) is not a
  /// refusal: that rank rethrows it as it came, the others throw
  /// DistributedError (ABORTED) naming the rank and what it threw, and no
  /// rank loads anything. The buffers in which the ranks tell each other
  /// their verdicts (1 KB per rank) are made before the check, so that a
  /// check that ran out of memory is still told; a rank that cannot make
  /// them aborts the group and rethrows. A
  /// failed agreement between the ranks throws DistributedError. A rank
  /// whose load fails after every check passed rethrows the failure and
  /// ends the group, so that the others' next collective fails at once.
  void LoadStateDict(const nn::optim::NamedTensors& state);

  /// The entries of a whole state that this rank's shard holds: "lr", the
  /// options ("group.*", and "param_groups.*" with several groups, each
  /// group's size and members replaced by the pieces of it this shard
  /// holds), and
  /// for each parameter it owns a piece of, the "state." entries cut to that
  /// piece ("step" counts as they are; the others, which have the
  /// parameter's shape, as 1-D pieces). What LoadStateDict loads; not
  /// collective. Throws std::invalid_argument naming a "state." key of no
  /// parameter, one whose tensor (other than "step") has not the
  /// parameter's shape (as the unsharded optimizer refuses it; for a
  /// parameter of no elements, which no shard holds, every rank checks
  /// its entries, and its "step" must be an i64 [] >= 0), a
  /// group whose saved size or members are not this optimizer's, or a
  /// parameter of this shard that is trained (requires_grad, or has a
  /// gradient) and absent from a state that lists every parameter
  /// ("group.params_listed": one saved by an optimizer over others).
  nn::optim::NamedTensors ShardOf(const nn::optim::NamedTensors& state) const;

  /// The shards: the parameters' elements laid end to end in the given
  /// order, cut at about r * total / world_size for r = 1 .. world_size - 1,
  /// each cut moved down to a multiple of kAlignment elements from the start
  /// of the parameter it falls in (a piece starts on a whole vector of
  /// registers). Rank r gets the run between cuts r and r + 1; a rank may get
  /// nothing when the parameters are few and small. A group added later
  /// (AddParamGroup) is cut the same way on its own, its pieces appended to
  /// each rank's shard.
  static std::vector<std::vector<Slice>> Partition(const nn::optim::NamedParameters& params,
                                                   int world_size);
  static constexpr int64_t kAlignment = 16;

 private:
  // The constructors' shared part: `group_of` gives each parameter's group
  // (all zero for a plain list), `options` describes each group's options
  // for the cross-rank comparison (empty for a plain list), and `build`
  // makes the local optimizer from this rank's pieces, named.
  void Init(const std::vector<size_t>& group_of, const std::vector<std::string>& options,
            const std::function<std::unique_ptr<nn::optim::Optimizer>(nn::optim::NamedParameters)>& build);
  // Each group's parameter names in the whole list (internal::RewriteGroups
  // converts a state between them and a shard's), and in rank r's shard
  // (a name per piece); the number of pieces per group in rank r's shard.
  std::vector<std::vector<std::string>> WholeGroupMembers() const;
  // Throws std::logic_error (naming `what`, the calling member) when the
  // shard's optimizer no longer holds the pieces it was given, or after an
  // AddParamGroup that failed on other ranks only.
  void CheckLocal(const char* what) const;
  std::vector<std::vector<std::string>> ShardGroupMembers(int r) const;
  std::vector<int64_t> ShardGroupSizes(int r) const;

  nn::optim::NamedParameters params_;
  std::vector<size_t> group_of_;  // per parameter: its group
  std::vector<nn::Shape> shapes_;  // per parameter: its shape at construction (Step checks it)
  size_t num_groups_ = 1;
  std::shared_ptr<ProcessGroup> pg_;
  std::vector<std::vector<Slice>> shards_;   // by rank
  std::vector<std::vector<nn::Tensor>> pieces_;  // by rank: views of the parameters
  std::unique_ptr<nn::optim::Optimizer> local_;  // over pieces_[rank]
  std::string broken_;  // why the shards no longer match across ranks (AddParamGroup); "" while they do
};

namespace internal {

/// Makes the next ZeroRedundancyOptimizer::AddParamGroup in this process
/// throw std::bad_alloc where it makes its new lists of parameters, shards
/// and pieces (as on a rank whose memory ran out there). For tests.
void FailNextAddParamGroupForTesting();

}  // namespace internal

}  // namespace ddp::dist

#endif  // DDP_DDP_ZERO_REDUNDANCY_OPTIMIZER_H_
