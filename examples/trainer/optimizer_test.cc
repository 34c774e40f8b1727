#include "examples/trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/trainer/zoo.h"
#include "gtest/gtest.h"
#include "nn/optim/lr_scheduler.h"

namespace ddp::examples::trainer {
namespace {

std::shared_ptr<nn::modules::Module> Model(const TrainConfig& c) {
  const nn::data::ImageShape shape =
      c.model == "mlp" ? nn::data::ImageShape{1, 28, 28} : nn::data::ImageShape{3, 32, 32};
  return MakeModel(c, shape, 10);
}

std::vector<std::string> Names(const nn::optim::NamedParameters& params) {
  std::vector<std::string> out;
  for (const auto& [name, p] : params) out.push_back(name);
  return out;
}

// The f64 scalar `key` of a state list; NaN when absent.
double ScalarIn(const nn::optim::NamedTensors& state, const std::string& key) {
  for (const auto& [name, t] : state) {
    if (name == key) return t.Item();
  }
  return NAN;
}

bool Has(const nn::optim::NamedTensors& state, const std::string& key) {
  for (const auto& [name, t] : state) {
    if (name == key) return true;
  }
  return false;
}

// Without --decay_norm_and_bias: exactly the parameters of at most one
// dimension (biases, BatchNorm weights and biases) in group 1 without weight
// decay, the others in group 0 with --weight_decay, each in the model's order;
// for every --optimizer.
TEST(OptimizerTest, NormsAndBiasesFormAGroupWithoutWeightDecay) {
  for (const std::string optimizer : {"sgd", "adam", "adamw", "adadelta", "rmsprop", "adagrad"}) {
    SCOPED_TRACE(optimizer);
    TrainConfig c;
    c.model = "resnet18";
    c.optimizer = optimizer;
    c.momentum = optimizer == "sgd" || optimizer == "rmsprop" ? 0.9 : 0.0;
    c.weight_decay = 0.01;
    c.decay_norm_and_bias = false;
    const auto model = Model(c);
    const nn::optim::NamedParameters all = model->NamedParameters();
    std::vector<std::string> small, large;
    for (const auto& [name, p] : all) (p.dim() <= 1 ? small : large).push_back(name);
    ASSERT_FALSE(small.empty());
    ASSERT_FALSE(large.empty());
    // BatchNorm's weight and bias and the classifier's bias are among them.
    EXPECT_NE(std::find(small.begin(), small.end(), "bn1.weight"), small.end());
    EXPECT_NE(std::find(small.begin(), small.end(), "bn1.bias"), small.end());
    EXPECT_NE(std::find(large.begin(), large.end(), "conv1.weight"), large.end());

    const auto opt = MakeOptimizer(c, ParamGroupsOf(c, all));
    ASSERT_EQ(opt->num_groups(), 2u);
    EXPECT_EQ(Names(opt->group_params(0)), large);
    EXPECT_EQ(Names(opt->group_params(1)), small);
    EXPECT_EQ(opt->params().size(), all.size());
    const nn::optim::NamedTensors state = opt->StateDict();
    EXPECT_EQ(ScalarIn(state, "param_groups.0.weight_decay"), 0.01);
    EXPECT_EQ(ScalarIn(state, "param_groups.1.weight_decay"), 0.0);
    EXPECT_EQ(opt->lr(0), c.lr);
    EXPECT_EQ(opt->lr(1), c.lr);
  }
}

// Text of the u8 state entry `key`; empty when absent.
std::string TextIn(const nn::optim::NamedTensors& state, const std::string& key) {
  for (const auto& [name, t] : state) {
    if (name == key) {
      const std::vector<uint8_t> bytes = t.ToVector<uint8_t>();
      return std::string(bytes.begin(), bytes.end());
    }
  }
  return "";
}

// --optimizer=rmsprop and adagrad build PyTorch's RMSprop and Adagrad with
// --lr, --weight_decay and (RMSprop's) --momentum, the rest PyTorch's
// defaults; a name ValidateConfig would refuse is refused here too.
TEST(OptimizerTest, RmspropAndAdagradTakeTheirFlags) {
  TrainConfig c;
  c.model = "mlp";
  c.lr = 0.02;
  c.weight_decay = 0.001;
  const auto model = Model(c);
  c.optimizer = "rmsprop";
  c.momentum = 0.5;
  nn::optim::NamedTensors state = MakeOptimizer(c, ParamGroupsOf(c, model->NamedParameters()))->StateDict();
  EXPECT_EQ(TextIn(state, "group.optimizer"), "RMSprop");
  EXPECT_EQ(ScalarIn(state, "lr"), 0.02);
  EXPECT_EQ(ScalarIn(state, "group.momentum"), 0.5);
  EXPECT_EQ(ScalarIn(state, "group.weight_decay"), 0.001);
  EXPECT_EQ(ScalarIn(state, "group.alpha"), 0.99);
  c.optimizer = "adagrad";
  c.momentum = 0;
  state = MakeOptimizer(c, ParamGroupsOf(c, model->NamedParameters()))->StateDict();
  EXPECT_EQ(TextIn(state, "group.optimizer"), "Adagrad");
  EXPECT_EQ(ScalarIn(state, "lr"), 0.02);
  EXPECT_EQ(ScalarIn(state, "group.weight_decay"), 0.001);
  EXPECT_EQ(ScalarIn(state, "group.lr_decay"), 0.0);
  c.optimizer = "lbfgs";
  try {
    MakeOptimizer(c, ParamGroupsOf(c, model->NamedParameters()));
    ADD_FAILURE() << "an unknown --optimizer was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "MakeOptimizer: unknown --optimizer=lbfgs");
  }
}

TEST(OptimizerTest, TheMlpHasParametersInBothGroups) {
  TrainConfig c;
  c.model = "mlp";
  const auto model = Model(c);
  // Its weights are matrices, its biases vectors.
  c.decay_norm_and_bias = false;
  c.weight_decay = 0.01;
  const auto groups = ParamGroupsOf(c, model->NamedParameters());
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_FALSE(groups[0].params.empty());
  EXPECT_FALSE(groups[1].params.empty());
  EXPECT_TRUE(groups[0].options.empty());
  EXPECT_EQ(groups[1].options.at("weight_decay"), 0.0);
}

// The default decays every parameter with the plain optimizer of a list,
// whose state has the layout of runs before the flag: "lr" and "group.*",
// no "param_groups.*".
TEST(OptimizerTest, DefaultIsOneGroupWithTheOldStateLayout) {
  TrainConfig c;
  c.model = "mlp";
  c.weight_decay = 0.01;
  const auto model = Model(c);
  const auto groups = ParamGroupsOf(c, model->NamedParameters());
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_TRUE(groups[0].options.empty());
  const auto opt = MakeOptimizer(c, groups);
  EXPECT_EQ(opt->num_groups(), 1u);
  EXPECT_EQ(Names(opt->params()), Names(model->NamedParameters()));
  const nn::optim::NamedTensors state = opt->StateDict();
  EXPECT_TRUE(Has(state, "lr"));
  EXPECT_EQ(ScalarIn(state, "group.weight_decay"), 0.01);
  EXPECT_FALSE(Has(state, "param_groups.count"));
}

// A step on zero gradients is weight decay alone: it shrinks the matrices
// and leaves biases untouched.
TEST(OptimizerTest, AStepOnZeroGradientsLeavesBiasesAsTheyWere) {
  TrainConfig c;
  c.model = "mlp";
  c.momentum = 0;
  c.lr = 0.1;
  c.weight_decay = 0.01;
  c.decay_norm_and_bias = false;
  const auto model = Model(c);
  std::vector<std::vector<float>> before;
  for (const auto& [name, p] : model->NamedParameters()) {
    before.push_back(p.ToVector<float>());
    p.set_grad(nn::ZerosLike(p));
  }
  const auto opt = MakeOptimizer(c, ParamGroupsOf(c, model->NamedParameters()));
  opt->Step();
  size_t i = 0;
  for (const auto& [name, p] : model->NamedParameters()) {
    SCOPED_TRACE(name);
    const std::vector<float> after = p.ToVector<float>();
    if (p.dim() <= 1) {
      EXPECT_EQ(after, before[i]);
    } else {
      EXPECT_NE(after, before[i]);
    }
    ++i;
  }
}

// The scheduler's target moves both groups' rates together, and a bad rate
// changes neither.
TEST(OptimizerTest, EveryGroupsRateSetsEachGroup) {
  TrainConfig c;
  c.model = "mlp";
  c.weight_decay = 0.01;
  c.decay_norm_and_bias = false;
  const auto model = Model(c);
  const auto opt = MakeOptimizer(c, ParamGroupsOf(c, model->NamedParameters()));
  EXPECT_THROW(opt->set_lr(0.2), std::logic_error);
  const nn::optim::LrTarget target = EveryGroupsRate(*opt);
  target.set(0.25);
  EXPECT_EQ(opt->lr(0), 0.25);
  EXPECT_EQ(opt->lr(1), 0.25);
  EXPECT_EQ(target.get(), 0.25);
  EXPECT_THROW(target.set(-1.0), std::invalid_argument);
  EXPECT_EQ(opt->lr(0), 0.25);
  EXPECT_EQ(opt->lr(1), 0.25);
}

}  // namespace
}  // namespace ddp::examples::trainer
