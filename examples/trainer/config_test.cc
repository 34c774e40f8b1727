#include "examples/trainer/config.h"

#include <cmath>
#include <cstdlib>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

std::string ErrorOf(const TrainConfig& c) {
  try {
    ValidateConfig(c);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigTest, DefaultsAreValid) { EXPECT_EQ(ErrorOf(TrainConfig{}), ""); }

TEST(ConfigTest, UnknownModelListsTheKnownOnes) {
  TrainConfig c;
  c.model = "resnet152";
  EXPECT_EQ(ErrorOf(c),
            "unknown --model=resnet152; use one of cnn, mlp, resnet18, resnet34, resnet50");
}

// An unknown device is named as such before any check that compares with
// "cpu" or "cuda" (before, --device=gpu --zero --zero_overlap was told that
// --zero_overlap steps in host memory).
TEST(ConfigTest, UnknownDeviceIsReportedBeforeTheOptionsThatDependOnIt) {
  TrainConfig c;
  c.device = "gpu";
  EXPECT_EQ(ErrorOf(c), "unknown --device=gpu; use cpu or cuda");
  c.zero = true;
  c.zero_overlap = true;
  EXPECT_EQ(ErrorOf(c), "unknown --device=gpu; use cpu or cuda");
  c = TrainConfig{};
  c.device = "tpu";
  c.comm_hook = "bf16";
  c.amp = "bf16";
  EXPECT_EQ(ErrorOf(c), "unknown --device=tpu; use cpu or cuda");
  c.device = "cuda";
  EXPECT_EQ(ErrorOf(c), "");  // whether this build has CUDA is device.h's to say
}

// Double flags are shown as they read back: with std::to_string's six
// fixed decimals, --weight_decay=-1e-7 was refused as "-0.000000". A bad
// --lr was told to be ">= 0", and 0 was then refused in turn.
TEST(ConfigTest, BadDoublesAreShownAsGiven) {
  TrainConfig c;
  c.weight_decay = -1e-7;
  EXPECT_EQ(ErrorOf(c), "--weight_decay=-1e-07 must be a finite number >= 0");
  c = TrainConfig{};
  c.lr = -0.05;
  EXPECT_EQ(ErrorOf(c), "--lr=-0.05 must be a finite number > 0");
  c = TrainConfig{};
  c.lr = std::nan("");
  EXPECT_EQ(ErrorOf(c), "--lr=nan must be a finite number > 0");
  c = TrainConfig{};
  c.lr = HUGE_VAL;
  EXPECT_EQ(ErrorOf(c), "--lr=inf must be a finite number > 0");
  c = TrainConfig{};
  c.momentum = 1.5;
  EXPECT_EQ(ErrorOf(c), "--momentum=1.5 must be below 1");
  c = TrainConfig{};
  c.momentum = 1;
  EXPECT_EQ(ErrorOf(c), "--momentum=1 must be below 1");
}

TEST(ConfigTest, BadValuesNameTheFlag) {
  TrainConfig c;
  c.batch_size = 0;
  EXPECT_EQ(ErrorOf(c), "--batch_size=0 must be at least 1");
  // Integer flags are shown as given, not through a double ("-5.000000").
  c = TrainConfig{};
  c.max_steps = -5;
  EXPECT_EQ(ErrorOf(c), "--max_steps=-5 must be at least 0");
  c = TrainConfig{};
  c.test_samples = -9007199254740993;  // not a double
  EXPECT_EQ(ErrorOf(c), "--test_samples=-9007199254740993 must be at least 0");
  c = TrainConfig{};
  c.workers = -1;
  EXPECT_EQ(ErrorOf(c), "--workers=-1 must be at least 0");
  for (double mb : {0.0, -1.0, 1e13, std::nan("")}) {
    c = TrainConfig{};
    c.bucket_cap_mb = mb;
    EXPECT_NE(ErrorOf(c).find("must be a positive number of MiB, at most 1048576 (1 TiB)"), std::string::npos) << mb;
    EXPECT_EQ(ErrorOf(c).rfind("--bucket_cap_mb=", 0), 0u) << ErrorOf(c);
  }
  c = TrainConfig{};
  c.amp = "fp8";
  EXPECT_EQ(ErrorOf(c), "unknown --amp=fp8; use one of off, bf16, fp16");
  c = TrainConfig{};
  c.optimizer = "adam";
  EXPECT_NE(ErrorOf(c).find("--momentum applies to --optimizer=sgd and rmsprop only"), std::string::npos);
  c.optimizer = "adagrad";
  EXPECT_EQ(ErrorOf(c), "--momentum applies to --optimizer=sgd and rmsprop only; drop it for --optimizer=adagrad");
  c.optimizer = "rmsprop";
  EXPECT_EQ(ErrorOf(c), "");
  c.momentum = 0;
  c.optimizer = "adagrad";
  EXPECT_EQ(ErrorOf(c), "");
  c.optimizer = "lbfgs";
  EXPECT_EQ(ErrorOf(c), "unknown --optimizer=lbfgs; use one of sgd, adam, adamw, adadelta, rmsprop, adagrad");
  // nn/cuda has a kernel for every optimizer: each is taken with --device=cuda.
  c.device = "cuda";
  for (const std::string optimizer : {"sgd", "adam", "adamw", "adadelta", "rmsprop", "adagrad"}) {
    c.optimizer = optimizer;
    EXPECT_EQ(ErrorOf(c), "") << optimizer;
  }
  c.device = "cpu";
  c = TrainConfig{};
  c.sync_bn = true;
  EXPECT_NE(ErrorOf(c).find("--sync_bn"), std::string::npos);
  c = TrainConfig{};
  c.zero = true;
  c.amp = "fp16";
  EXPECT_NE(ErrorOf(c).find("--zero"), std::string::npos);
  EXPECT_NE(ErrorOf(c).find("--amp=bf16"), std::string::npos);
  c.amp = "bf16";
  EXPECT_EQ(ErrorOf(c), "");
  c = TrainConfig{};
  c.zero_overlap = true;
  EXPECT_NE(ErrorOf(c).find("add --zero"), std::string::npos);
  c.zero = true;
  EXPECT_EQ(ErrorOf(c), "");
  c.comm_hook = "bf16";
  EXPECT_NE(ErrorOf(c).find("--comm_hook=bf16"), std::string::npos);
  c.comm_hook = "allreduce";
  c.device = "cuda";
  EXPECT_NE(ErrorOf(c).find("--device=cuda"), std::string::npos);
  c.device = "cpu";
  c.find_unused_parameters = true;
  EXPECT_NE(ErrorOf(c).find("--find_unused_parameters"), std::string::npos);
  c = TrainConfig{};
  c.resume = true;
  c.checkpoint = "";
  EXPECT_NE(ErrorOf(c).find("--resume needs a checkpoint"), std::string::npos);
}

// --powersgd_start_step mirrors PowerSgdOptions::start_iteration (>= 0), and
// like other flags that would do nothing it is refused without the hook.
TEST(ConfigTest, PowerSgdStartStepIsCheckedAndNeedsThePowerSgdHook) {
  TrainConfig c;
  c.comm_hook = "powersgd";
  c.powersgd_start_step = -1;
  EXPECT_EQ(ErrorOf(c), "--powersgd_start_step=-1 must be at least 0");
  c.powersgd_start_step = 0;
  EXPECT_EQ(ErrorOf(c), "");
  c.comm_hook = "bf16";
  EXPECT_EQ(ErrorOf(c),
            "--powersgd_start_step applies to --comm_hook=powersgd only; drop it for --comm_hook=bf16");
  c.powersgd_start_step = TrainConfig{}.powersgd_start_step;
  EXPECT_EQ(ErrorOf(c), "");
}

// --log_every spaces metrics.csv's rows; without --log_dir there are none,
// and like other flags that would do nothing it is refused.
TEST(ConfigTest, LogEveryNeedsALogDir) {
  TrainConfig c;
  c.log_every = 5;
  EXPECT_EQ(ErrorOf(c),
            "--log_every=5 sets the steps per metrics.csv row, which only --log_dir writes; add "
            "--log_dir=DIR, or drop --log_every");
  c.log_dir = "/tmp/logs";
  EXPECT_EQ(ErrorOf(c), "");
  c.log_every = 0;
  EXPECT_EQ(ErrorOf(c), "--log_every=0 must be at least 1");
  c = TrainConfig{};
  c.log_every = TrainConfig{}.log_every;
  EXPECT_EQ(ErrorOf(c), "");
}

// --cycle_momentum: onecycle's, over an optimizer with a momentum that an
// unsharded scheduler can drive; refused otherwise, naming the flags.
TEST(ConfigTest, CycleMomentumNeedsOneCycleAndAMomentum) {
  TrainConfig c;
  c.cycle_momentum = true;
  EXPECT_EQ(ErrorOf(c), "--cycle_momentum applies to --scheduler=onecycle only; drop it for --scheduler=cosine");
  c.scheduler = "onecycle";
  EXPECT_EQ(ErrorOf(c), "");
  c.optimizer = "adamw";
  c.momentum = 0;
  EXPECT_EQ(ErrorOf(c), "");
  for (const std::string optimizer : {"adadelta", "adagrad"}) {
    c.optimizer = optimizer;
    EXPECT_EQ(ErrorOf(c),
              "--cycle_momentum cycles SGD's or RMSprop's momentum or Adam's beta1, and --optimizer=" +
                  optimizer + " has neither; use sgd, rmsprop, adam or adamw, or drop --cycle_momentum");
  }
  c.optimizer = "rmsprop";
  EXPECT_EQ(ErrorOf(c),
            "--cycle_momentum cycles RMSprop's momentum, and --momentum=0 (its default) makes an RMSprop "
            "without one; give --momentum above 0 (the cycle then sets it), or drop --cycle_momentum");
  c.momentum = 0.5;
  EXPECT_EQ(ErrorOf(c), "");
  c.momentum = 0;
  c.optimizer = "sgd";
  EXPECT_EQ(ErrorOf(c),
            "--cycle_momentum cycles SGD's momentum, and --momentum=0 makes an SGD without one; "
            "drop --momentum=0 (the cycle sets the momentum), or --cycle_momentum");
  c.momentum = 0.9;
  c.zero = true;
  EXPECT_EQ(ErrorOf(c),
            "--cycle_momentum cannot apply with --zero, whose sharded optimizer's schedule drives "
            "the learning rate only; drop one of the two");
}

TEST(ConfigTest, EverySchedulerIsKnownAndAnUnknownOneListsThem) {
  TrainConfig c;
  c.scheduler = "linear";
  EXPECT_EQ(ErrorOf(c),
            "unknown --scheduler=linear; use one of none, step, multistep, exponential, cosine, "
            "warm_restarts, onecycle, plateau");
  // Each valid with the flags it needs.
  for (const std::string& kind : SchedulerNames()) {
    c = TrainConfig{};
    c.scheduler = kind;
    if (kind == "exponential") c.lr_gamma = 0.999;
    if (kind == "multistep") c.lr_milestones = {100, 200};
    if (kind == "warm_restarts") c.lr_t0 = 50;
    EXPECT_EQ(ErrorOf(c), "") << kind;
  }
}

// A schedule's flag given to another schedule would do nothing: refused
// naming the schedulers it applies to, as --powersgd_start_step is.
TEST(ConfigTest, ScheduleFlagsApplyToTheirSchedulersOnly) {
  TrainConfig c;  // cosine
  c.lr_gamma = 0.5;
  EXPECT_EQ(ErrorOf(c),
            "--lr_gamma applies to --scheduler=step, multistep, exponential or plateau only; drop "
            "it for --scheduler=cosine");
  c.scheduler = "step";
  EXPECT_EQ(ErrorOf(c), "");
  c = TrainConfig{};
  c.scheduler = "step";
  c.lr_milestones = {10};
  EXPECT_EQ(ErrorOf(c), "--lr_milestones applies to --scheduler=multistep only; drop it for --scheduler=step");
  c = TrainConfig{};
  c.scheduler = "onecycle";
  c.lr_t0 = 10;
  EXPECT_EQ(ErrorOf(c),
            "--lr_t0 applies to --scheduler=warm_restarts only; drop it for --scheduler=onecycle");
  c = TrainConfig{};
  c.lr_t_mult = 2;
  EXPECT_EQ(ErrorOf(c),
            "--lr_t_mult applies to --scheduler=warm_restarts only; drop it for --scheduler=cosine");
  c = TrainConfig{};
  c.scheduler = "none";
  c.lr_patience = 2;
  EXPECT_EQ(ErrorOf(c), "--lr_patience applies to --scheduler=plateau only; drop it for --scheduler=none");
  c.scheduler = "plateau";
  EXPECT_EQ(ErrorOf(c), "");
  // Given on the command line at its default value: still another
  // scheduler's flag (the values alone could not tell).
  c = TrainConfig{};
  c.schedule_flags_given = {"lr_patience"};
  EXPECT_EQ(ErrorOf(c), "--lr_patience applies to --scheduler=plateau only; drop it for --scheduler=cosine");
  c = TrainConfig{};
  c.scheduler = "warm_restarts";
  c.schedule_flags_given = {"lr_t0"};  // --lr_t0=0
  EXPECT_EQ(ErrorOf(c), "--lr_t0=0 must be at least 1");
}

// The flags a schedule cannot do without are asked for by name; values out
// of range name the flag.
TEST(ConfigTest, ScheduleFlagsAreNeededWhereTheyHaveNoDefaultAndChecked) {
  TrainConfig c;
  c.scheduler = "exponential";
  EXPECT_EQ(ErrorOf(c),
            "--scheduler=exponential needs --lr_gamma, the rate's factor per optimizer step "
            "(0.999, say)");
  for (double bad : {0.0, -0.5, std::nan(""), static_cast<double>(INFINITY)}) {
    c.lr_gamma = bad;
    EXPECT_NE(ErrorOf(c).find("must be a finite number above 0"), std::string::npos) << bad;
    EXPECT_EQ(ErrorOf(c).rfind("--lr_gamma=", 0), 0u) << ErrorOf(c);
  }
  c = TrainConfig{};
  c.scheduler = "plateau";
  c.lr_gamma = 1.0;
  EXPECT_EQ(ErrorOf(c),
            "--lr_gamma=1 must be below 1 for --scheduler=plateau, which multiplies the rate by it "
            "to reduce it");
  c.lr_gamma = 0.5;
  c.lr_patience = -1;
  EXPECT_EQ(ErrorOf(c), "--lr_patience=-1 must be at least 0");
  c = TrainConfig{};
  c.scheduler = "multistep";
  EXPECT_EQ(ErrorOf(c),
            "--scheduler=multistep needs --lr_milestones, the optimizer steps where the rate is "
            "multiplied by --lr_gamma (1000,2000, say)");
  c.lr_milestones = {300, 200};
  EXPECT_EQ(ErrorOf(c), "--lr_milestones=300,200 must be in ascending order");
  c.lr_milestones = {0, 200};
  EXPECT_EQ(ErrorOf(c), "--lr_milestones=0,200: milestones are optimizer steps, at least 1");
  c.lr_milestones = {200, 200};  // as PyTorch: gamma twice
  EXPECT_EQ(ErrorOf(c), "");
  c = TrainConfig{};
  c.scheduler = "warm_restarts";
  EXPECT_EQ(ErrorOf(c),
            "--scheduler=warm_restarts needs --lr_t0, the optimizer steps of its first cycle");
  c.lr_t0 = -3;
  EXPECT_EQ(ErrorOf(c), "--lr_t0=-3 must be at least 1");
  c.lr_t0 = 10;
  c.lr_t_mult = 0;
  EXPECT_EQ(ErrorOf(c), "--lr_t_mult=0 must be at least 1");
}

TEST(ConfigTest, MilestonesParseAsCommaSeparatedSteps) {
  EXPECT_EQ(ParseMilestones(""), std::vector<int64_t>{});
  EXPECT_EQ(ParseMilestones("5"), std::vector<int64_t>{5});
  EXPECT_EQ(ParseMilestones("1000,2000"), (std::vector<int64_t>{1000, 2000}));
  EXPECT_EQ(FormatMilestones({1000, 2000}), "1000,2000");
  for (const char* bad : {"1000,", ",5", "1e3", "10, 20", "-5", "x", "1234567890123456789"}) {
    try {
      ParseMilestones(bad);
      ADD_FAILURE() << bad << " was taken";
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()), std::string("--lr_milestones=") + bad +
                                           " is not a list of optimizer steps; write them as 1000,2000");
    }
  }
}

// Synthetic images read no folder: a --data_dir given with them was dropped
// without a word (perhaps meant for --dataset=cifar10).
TEST(ConfigTest, DataDirWithSyntheticDataIsRefused) {
  TrainConfig c;
  c.dataset = "synthetic";
  EXPECT_EQ(ErrorOf(c), "");
  c.data_dir = "/data/cifar-10-batches-bin";
  EXPECT_EQ(ErrorOf(c),
            "--data_dir=/data/cifar-10-batches-bin would not be read: --dataset=synthetic generates "
            "its images; drop --data_dir, or pass the --dataset whose files it holds "
            "(fashion_mnist, mnist or cifar10)");
  c.dataset = "cifar10";
  EXPECT_EQ(ErrorOf(c), "");
}

TEST(ConfigTest, PathsAreRelativeToTheUsersDirectory) {
  setenv("BUILD_WORKING_DIRECTORY", "/home/someone/project", 1);
  setenv("XDG_CACHE_HOME", "/cache", 1);
  TrainConfig c;
  c.checkpoint = kDefaultCheckpoint;
  c.log_dir = "runs/a";
  c.data_dir = "../data";
  ResolvePaths(c);
  EXPECT_EQ(c.checkpoint, "/cache/ddp/checkpoints/cnn_fashion_mnist.safetensors");
  EXPECT_EQ(c.log_dir, "/home/someone/project/runs/a");
  EXPECT_EQ(c.data_dir, "/home/someone/data");
  c.checkpoint = "none";
  ResolvePaths(c);
  EXPECT_EQ(c.checkpoint, "");
  unsetenv("BUILD_WORKING_DIRECTORY");
  unsetenv("XDG_CACHE_HOME");
}

// The step inside backward takes parameter groups (it refused
// --decay_norm_and_bias=false before OverlappedZeroOptimizer did).
TEST(ConfigTest, DecayNormAndBiasOffIsTakenWithZeroOverlap) {
  TrainConfig c;
  c.zero = true;
  c.zero_overlap = true;
  c.weight_decay = 0.01;
  c.decay_norm_and_bias = false;
  EXPECT_EQ(ErrorOf(c), "");
}

}  // namespace
}  // namespace ddp::examples::trainer
