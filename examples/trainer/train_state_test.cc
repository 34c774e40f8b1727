#include "examples/trainer/train_state.h"

#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <set>

#include "ddp/comm_hooks.h"
#include "ddp/powersgd_hook.h"
#include "ddp/process_group.h"
#include "gtest/gtest.h"
#include "nn/autograd/engine.h"
#include "nn/data/sampler.h"
#include "nn/io/atomic_file.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/sgd.h"

// The path whose stat fails with EIO in this test program, as on a failing
// disk (none while empty); set by the test that needs it.
std::string stat_eio_path;

// stat, in place of the C library's for the whole test program: EIO for
// stat_eio_path, else the C library's.
extern "C" int stat(const char* path, struct stat* st) noexcept {
  if (!stat_eio_path.empty() && stat_eio_path == path) {
    errno = EIO;
    return -1;
  }
  using Stat = int (*)(const char*, struct stat*);
  static const Stat real = reinterpret_cast<Stat>(::dlsym(RTLD_NEXT, "stat"));
  return real(path, st);
}

namespace ddp::examples::trainer {
namespace {

std::string Path(const std::string& name) {
  return std::string(std::getenv("TEST_TMPDIR")) + "/ckpt/" + name + ".safetensors";
}

// One SGD step on random data, so that the optimizer has momentum state.
void TrainOneStep(nn::modules::Module& model, nn::optim::Optimizer& opt) {
  nn::Generator gen(7);
  const nn::Tensor x = nn::Randn({4, 1, 28, 28}, {}, gen);
  nn::Backward(nn::ops::Sum(model.Forward(x)));
  opt.Step();
  opt.ZeroGrad();
}

std::string UsageErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainStateTest, RoundTripsModelOptimizerAndPosition) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;  // as the optimizers below
  nn::Generator g1(1), g2(2);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  TrainPosition pos{.epoch = 1, .batch_in_epoch = 17, .step = 486,
                    .epoch_loss_sum = 1.0 / 3.0, .epoch_loss_count = 34};
  const std::string path = Path("roundtrip");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, pos, config, 2);

  auto other = nn::modules::MakeMlp(g2);
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  std::string note;
  const TrainPosition back =
      LoadTrainCheckpoint(path, {other.get(), &other_opt, nullptr, nullptr}, config, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_EQ(back.epoch, 1);
  EXPECT_EQ(back.batch_in_epoch, 17);
  EXPECT_EQ(back.step, 486);
  EXPECT_EQ(back.epoch_loss_sum, 1.0 / 3.0);
  EXPECT_EQ(back.epoch_loss_count, 34);
  const auto a = model->GetStateDict();
  const auto b = other->GetStateDict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.ToVector<float>(), b[i].second.ToVector<float>()) << a[i].first;
  }
  const auto sa = opt.StateDict();
  const auto sb = other_opt.StateDict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].second.ToVector<double>(), sb[i].second.ToVector<double>()) << sa[i].first;
  }
}

// Only the optimizer's refusal of the saved state (std::invalid_argument) is
// bad input. A failure of the process or the job while loading it (out of
// memory; a collective of a sharded load that failed) goes on as it came:
// it used to become a UsageError (exit status 2, "bad input"), which the
// trainer then reported on ranks other than 0 as rank 0's refusal.
TEST(TrainStateTest, OnlyARefusalOfTheOptimizerStateIsAUsageError) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  nn::Generator g1(1), g2(2);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  const std::string path = Path("load_failures");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {.step = 1}, config, 2);

  auto other = nn::modules::MakeMlp(g2);
  const auto before = other->GetStateDict()[0].second.ToVector<float>();
  TrainComponents parts{other.get(), nullptr, nullptr, nullptr};
  std::string note;
  const auto load = [&] { LoadTrainCheckpoint(path, parts, config, 2, &note); };

  parts.load_optimizer = [](const nn::optim::NamedTensors&) { throw std::bad_alloc(); };
  EXPECT_THROW(load(), std::bad_alloc);
  parts.load_optimizer = [](const nn::optim::NamedTensors&) {
    throw dist::DistributedError(transport::PeerLostError("rank 1 left"));
  };
  try {
    load();
    ADD_FAILURE() << "the load went through";
  } catch (const UsageError& e) {
    ADD_FAILURE() << "a failed collective became bad input: " << e.what();
  } catch (const dist::DistributedError& e) {
    EXPECT_EQ(e.code(), transport::StatusCode::kPeerLost) << e.what();
  }
  parts.load_optimizer = [](const nn::optim::NamedTensors&) {
    throw std::invalid_argument("Sgd.LoadStateDict: unexpected key `state.x`");
  };
  const std::string refused = UsageErrorOf(load);
  EXPECT_EQ(refused, "checkpoint " + path + " has optimizer state this run cannot use (Sgd.LoadStateDict: "
                     "unexpected key `state.x`); pass the --optimizer, --scheduler and --amp it was saved with");
  EXPECT_EQ(other->GetStateDict()[0].second.ToVector<float>(), before) << "the model was loaded";
}

// The epoch's loss is kept per sample (each micro-batch's mean times its
// samples). An older trainer's checkpoint, without epoch_loss_per, counted
// batches, all full inside an epoch: its sum and count come back times
// its batch size, so that the steps a resume adds count alike and the mean
// stays as saved.
TEST(TrainStateTest, AnOlderCheckpointsEpochLossPerBatchLoadsPerSample) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  config.batch_size = 16;
  nn::Generator g1(1);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainPosition pos{.epoch = 1, .batch_in_epoch = 17, .step = 486,
                    .epoch_loss_sum = 1.0 / 3.0, .epoch_loss_count = 34};
  const std::string path = Path("older_epoch_loss");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, pos, config, 2);
  nn::io::Checkpoint older = nn::io::LoadCheckpoint(path);
  ASSERT_EQ(older.metadata["epoch_loss_per"], "sample");
  older.metadata.erase("epoch_loss_per");
  nn::io::SaveCheckpoint(path, older);
  std::string note;
  const TrainPosition back =
      LoadTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, config, 2, &note);
  EXPECT_EQ(back.epoch_loss_sum, 16.0 / 3.0);
  EXPECT_EQ(back.epoch_loss_count, 34 * 16);
}

// --comm_hook=powersgd: the hook's iteration and Q are saved (not this
// rank's residuals) and restored, so a resumed run compresses from its
// first step instead of warming up again; a state for other settings is
// refused naming PowerSGD, and nothing is loaded.
TEST(TrainStateTest, PowerSgdIterationAndQRoundTripAndAMismatchIsRefused) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  nn::Generator g1(1), g2(2), g3(3);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  const dist::PowerSgdOptions options{.matrix_approximation_rank = 1, .start_iteration = 2};
  auto state = std::make_shared<dist::PowerSgdState>(options);
  {
    // One process: the hook called directly on a bucket of the first
    // weight, past its start.
    auto pg = dist::ProcessGroup::Single();
    dist::CommHook hook = dist::hooks::PowerSgdHook(state);
    const nn::Tensor w = model->NamedParameters().at(0).second;
    nn::Generator gen(9);
    for (int k = 0; k < 3; ++k) {
      dist::GradBucket bucket(0, 1, nn::Randn({w.numel()}, {}, gen), {w}, {0});
      hook(*pg, bucket).Wait();
    }
  }
  const std::string path = Path("powersgd");
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  parts.powersgd = state.get();
  SaveTrainCheckpoint(path, parts, {.step = 3}, config, 2);
  const std::string q_key = "powersgd.q." + model->NamedParameters().at(0).first;
  std::set<std::string> saved_keys;
  for (const auto& [key, t] : nn::io::LoadCheckpoint(path).optimizer) {
    if (key.rfind("powersgd.", 0) == 0) saved_keys.insert(key);
  }
  EXPECT_EQ(saved_keys, (std::set<std::string>{"powersgd.iteration", q_key}));

  auto other = nn::modules::MakeMlp(g2);
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  auto resumed = std::make_shared<dist::PowerSgdState>(options);
  TrainComponents back{other.get(), &other_opt, nullptr, nullptr};
  back.powersgd = resumed.get();
  std::string note;
  LoadTrainCheckpoint(path, back, config, 2, &note);
  EXPECT_EQ(resumed->iteration(), 3);
  const auto want = state->StateDict(model->NamedParameters());
  const auto got = resumed->StateDict(other->NamedParameters());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.ToVector<double>(), want[i].second.ToVector<double>()) << want[i].first;
  }

  // Rank 2 needs another Q: refused, naming PowerSGD and the setting.
  auto third = nn::modules::MakeMlp(g3);
  nn::optim::Sgd third_opt(third->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  const auto before = third->GetStateDict()[0].second.ToVector<float>();
  dist::PowerSgdOptions rank_two = options;
  rank_two.matrix_approximation_rank = 2;
  dist::PowerSgdState refusing(rank_two);
  TrainComponents mismatched{third.get(), &third_opt, nullptr, nullptr};
  mismatched.powersgd = &refusing;
  const std::string err = UsageErrorOf([&] { LoadTrainCheckpoint(path, mismatched, config, 2, &note); });
  EXPECT_NE(err.find("PowerSGD state this run cannot use"), std::string::npos) << err;
  EXPECT_NE(err.find("matrix_approximation_rank 2"), std::string::npos) << err;
  EXPECT_EQ(refusing.iteration(), 0);
  EXPECT_EQ(third->GetStateDict()[0].second.ToVector<float>(), before) << "the model was loaded";
  EXPECT_EQ(third_opt.StateDict().size(), nn::optim::Sgd(third->NamedParameters(), {.lr = 0.1, .momentum = 0.9})
                                              .StateDict()
                                              .size())
      << "the optimizer was loaded";

  // Saved without PowerSGD (another hook): the state is left as it is.
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {.step = 3}, config, 2);
  dist::PowerSgdState untouched(options);
  TrainComponents plain{other.get(), &other_opt, nullptr, nullptr};
  plain.powersgd = &untouched;
  LoadTrainCheckpoint(path, plain, config, 2, &note);
  EXPECT_EQ(untouched.iteration(), 0);
}

// DDP's bucket order is saved when the run had one and read back as it
// was; none saved, or a malformed one, reads as none.
TEST(TrainStateTest, BucketOrderRoundTripsAndAMalformedOneReadsAsNone) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  nn::Generator gen(1);
  auto model = nn::modules::MakeMlp(gen);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  const std::string path = Path("bucket_order");
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  SaveTrainCheckpoint(path, parts, {.step = 3}, config, 3);
  EXPECT_EQ(nn::io::LoadCheckpoint(path).metadata.count("bucket_order"), 0u);
  EXPECT_TRUE(LoadTrainCheckpoint(path, parts, config, 3, nullptr).bucket_order.empty());

  parts.bucket_order = {2, 3, 0, 1};
  SaveTrainCheckpoint(path, parts, {.step = 3}, config, 3);
  EXPECT_EQ(nn::io::LoadCheckpoint(path).metadata.at("bucket_order"), "2,3,0,1");
  EXPECT_EQ(LoadTrainCheckpoint(path, parts, config, 3, nullptr).bucket_order,
            (std::vector<int64_t>{2, 3, 0, 1}));

  for (const std::string bad : {"2,,0", "2,3,", "-1,0", "a", "2, 3"}) {
    nn::io::Checkpoint ckpt = nn::io::LoadCheckpoint(path);
    ckpt.metadata["bucket_order"] = bad;
    nn::io::SaveCheckpoint(path, ckpt);
    EXPECT_TRUE(LoadTrainCheckpoint(path, parts, config, 3, nullptr).bucket_order.empty()) << bad;
  }
}

TEST(TrainStateTest, AnotherModelGetsTheKeysAndTheFix) {
  TrainConfig mlp_config;
  mlp_config.model = "mlp";
  auto mlp = nn::modules::MakeMlp();
  nn::optim::Sgd opt(mlp->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("mlp");
  SaveTrainCheckpoint(path, {mlp.get(), &opt, nullptr, nullptr}, {}, mlp_config, 1);

  TrainConfig cnn_config;
  auto cnn = nn::modules::MakeCnn();
  const std::string msg =
      UsageErrorOf([&] { CheckCheckpointMatchesModel(path, *cnn, cnn_config); });
  EXPECT_NE(msg.find("checkpoint " + path + " does not match --model=cnn"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("missing keys 0.weight, 0.bias, 7.weight, 7.bias, 9.weight, 9.bias;"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected keys 1.weight, 1.bias, 5.weight, 5.bias;"), std::string::npos) << msg;
  EXPECT_NE(msg.find("different shapes or dtypes 3.weight [256, 512] f32 vs [64, 32, 3, 3] f32"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("it was saved by --model=mlp; pass the same flags"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line";
}

TEST(TrainStateTest, MissingFileSaysHowToCreateIt) {
  auto mlp = nn::modules::MakeMlp();
  TrainConfig c;
  const std::string msg =
      UsageErrorOf([&] { CheckCheckpointMatchesModel(Path("absent"), *mlp, c); });
  EXPECT_NE(msg.find("no checkpoint at"), std::string::npos) << msg;
  EXPECT_NE(msg.find("run once without --resume"), std::string::npos) << msg;
}

// A path that cannot be looked at (here a name past NAME_MAX, which stat
// refuses with ENAMETOOLONG; a folder the user may not enter does the same
// with EACCES, but the tests run as root) is not "no checkpoint": the
// message names the path and the system's reason, and does not suggest
// starting afresh, which would replace a checkpoint that may be there.
TEST(TrainStateTest, PathThatCannotBeLookedAtIsNotCalledMissing) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + std::string(300, 'x');
  std::error_code ec;
  EXPECT_FALSE(std::filesystem::exists(path, ec));
  ASSERT_TRUE(ec) << "expected stat to fail on a 300-byte name";
  const std::string msg = UsageErrorOf([&] { ReadTrainCheckpoint(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(ec.message()), std::string::npos) << msg;
  EXPECT_EQ(msg.find("no checkpoint at"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("run once without --resume"), std::string::npos) << msg;
}

// A look at the path that the host fails (EIO: a failing disk) is not the
// user's mistake: --resume ends with the run's failure (not a UsageError)
// giving the system's reason, and no advice to fix the path. It was
// refused as a path "to fix".
TEST(TrainStateTest, PathWhoseLookTheHostFailsIsNotTheUsersMistake) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/eio.safetensors";
  stat_eio_path = path;
  std::string msg;
  bool usage = false;
  try {
    ReadTrainCheckpoint(path);
  } catch (const UsageError& e) {
    usage = true;
    msg = e.what();
  } catch (const std::runtime_error& e) {
    msg = e.what();
  }
  stat_eio_path.clear();
  EXPECT_FALSE(usage) << msg;
  EXPECT_NE(msg.find("--resume: cannot look at the checkpoint " + path + ": " + std::strerror(EIO) +
                     " (the host failed"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("fix the path"), std::string::npos) << msg;
}

// A read that the host fails (here EMFILE: no file descriptor left; EIO
// and ENOMEM alike) says nothing against the file: --resume ends with the
// system's reason as a failure (not a UsageError, so exit status 1), with
// no advice to delete what may be a good checkpoint. It was refused like a
// damaged file: "...; delete the file or pass another --checkpoint".
TEST(TrainStateTest, AReadTheHostFailsIsAFailureWithNoAdviceToDeleteTheFile) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/host_failure.safetensors";
  std::ofstream(path) << "whatever the checkpoint holds";
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // The lowest free descriptor: every one below it is in use, so a limit
  // there leaves none to open.
  const int lowest_free = dup(0);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit none = saved;
  none.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  std::string what;
  bool usage = false;
  try {
    ReadTrainCheckpoint(path);
  } catch (const UsageError& e) {
    usage = true;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_FALSE(usage) << what;
  EXPECT_NE(what.find("--resume: " + path + ": cannot open: " + std::strerror(EMFILE)), std::string::npos) << what;
  EXPECT_NE(what.find("the host failed to read it"), std::string::npos) << what;
  EXPECT_EQ(what.find("delete the file"), std::string::npos) << what;
  // A file that is no checkpoint is still refused as the file's fault.
  EXPECT_NE(UsageErrorOf([&] { ReadTrainCheckpoint(path); }).find("delete the file"), std::string::npos);
}

// A regular file among the checkpoint path's folders (the folder itself,
// or one above it) makes the path unreachable, which the system reports as
// absent: --resume said "no checkpoint ... run once without --resume to
// create it", and that run then failed on the same file. The line names
// the file instead.
TEST(TrainStateTest, AFileAmongTheCheckpointsFoldersIsNamedNotCalledMissing) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/file_for_folder";
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/notes.txt";
  std::ofstream(file) << "not a folder\n";
  for (const std::string& path : {file + "/c.safetensors", file + "/run1/c.safetensors"}) {
    const std::string msg = UsageErrorOf([&] { ReadTrainCheckpoint(path); });
    EXPECT_EQ(msg, "--resume: no checkpoint can be at " + path + ": " + file +
                       " is a file, not a folder; fix the path, or pass another --checkpoint");
  }
  // A folder that is merely missing is still missing.
  const std::string absent = dir + "/run2/c.safetensors";
  EXPECT_NE(UsageErrorOf([&] { ReadTrainCheckpoint(absent); }).find("run once without --resume"),
            std::string::npos);
}

// An elastic job on 4 ranks saved in the middle of epoch 2, after 3
// batches of 8 per rank, and lost a node: on 2 ranks it trains the rest of
// epoch 2, each sample the 4 ranks had not trained once and none they had,
// in the same number of batches on both ranks; the run ends that many
// steps later, and the schedule with it.
TEST(TrainStateTest, MidEpochCheckpointOnOtherRanksTrainsTheRestOfTheEpoch) {
  TrainConfig config;
  config.model = "mlp";
  config.epochs = 2;
  config.batch_size = 8;
  config.seed = 3;
  const int64_t n = 300;  // 75 per rank on 4 ranks, 10 batches
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  auto schedule = std::make_shared<RunSchedule>("cosine", RunEndStep(config, 10));
  nn::optim::LrScheduler scheduler(opt, schedule);
  for (int i = 0; i < 13; ++i) scheduler.Step();
  TrainComponents four{model.get(), &opt, &scheduler, nullptr};
  four.train_size = n;
  four.schedule = schedule.get();
  four.batches_per_epoch = 10;
  const std::string path = Path("other_ranks");
  SaveTrainCheckpoint(path, four, {.epoch = 1, .batch_in_epoch = 3, .step = 13}, config, 4);

  TrainComponents two = four;
  two.batches_per_epoch = BatchesInEpoch(n, 2, config.batch_size);
  EXPECT_EQ(two.batches_per_epoch, 19);
  std::string note;
  const TrainPosition pos = LoadTrainCheckpoint(path, two, config, 2, &note);
  EXPECT_EQ(pos.epoch, 1) << note;
  EXPECT_EQ(pos.epoch_start, 3 * 8 * 4);
  EXPECT_EQ(pos.batch_in_epoch, 0);
  EXPECT_EQ(pos.step, 13);
  EXPECT_EQ(pos.untrained_epochs, 0);
  EXPECT_EQ(note, "the checkpoint was saved in the middle of epoch 2 by a run on 4 ranks, batch 8, "
                  "after 96 samples of the epoch's order; this run trains the rest of that epoch; "
                  "the cosine schedule now ends at step 26, where this run ends (after --epochs=2 "
                  "at 19 steps per epoch), instead of the checkpoint's step 20");

  std::multiset<int64_t> untrained;
  for (int64_t r = 0; r < 4; ++r) {
    nn::data::DistributedSampler s(n, {.num_replicas = 4, .rank = r, .seed = config.seed});
    s.SetEpoch(pos.epoch);
    const std::vector<int64_t> mine = s.Indices();
    untrained.insert(mine.begin() + 3 * 8, mine.end());
  }
  std::multiset<int64_t> rest;
  for (int64_t r = 0; r < 2; ++r) {
    nn::data::DistributedSampler s(n, {.num_replicas = 2, .rank = r, .seed = config.seed});
    s.set_start(pos.epoch_start, pos.epoch);
    s.SetEpoch(pos.epoch);
    const std::vector<int64_t> mine = s.Indices();
    EXPECT_EQ(mine.size(), 102u) << "rank " << r;
    rest.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(rest, untrained);
  // 102 samples per rank: 13 batches of 8 to the end of the run.
  EXPECT_EQ(BatchesInEpoch(n, 2, config.batch_size, pos.epoch_start), 13);
  EXPECT_EQ(schedule->steps(), 13 + 13);
}

// A run resumed past an epoch's start saves that start, and continues from
// it: on the same ranks exactly where it was, on others after every
// sample trained so far.
TEST(TrainStateTest, EpochStartCarriesOverToTheNextResume) {
  TrainConfig config;
  config.model = "mlp";
  config.batch_size = 8;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  parts.train_size = 300;
  const std::string path = Path("epoch_start");
  SaveTrainCheckpoint(path, parts, {.epoch = 1, .batch_in_epoch = 4, .epoch_start = 96, .step = 17},
                      config, 2);
  std::string note;
  TrainPosition pos = LoadTrainCheckpoint(path, parts, config, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_EQ(pos.epoch_start, 96);
  EXPECT_EQ(pos.batch_in_epoch, 4);
  pos = LoadTrainCheckpoint(path, parts, config, 3, &note);
  EXPECT_EQ(pos.epoch, 1);
  EXPECT_EQ(pos.epoch_start, 96 + 4 * 8 * 2);
  EXPECT_EQ(pos.batch_in_epoch, 0);
}

// Another seed is another sample order: the samples not yet trained are
// unknown, so the run continues at the next epoch, and the one left does
// not count as done; when it was the last, the note says nothing is left.
TEST(TrainStateTest, AnotherSeedContinuesAtTheNextEpochNotCountedAsDone) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  config.epochs = 2;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("order");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr},
                      {.epoch = 0, .batch_in_epoch = 5, .step = 5}, config, 2);
  TrainConfig other_seed = config;
  other_seed.seed = 1;
  std::string note;
  TrainPosition pos =
      LoadTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, other_seed, 4, &note);
  EXPECT_EQ(pos.epoch, 1);
  EXPECT_EQ(pos.batch_in_epoch, 0);
  EXPECT_EQ(pos.epoch_start, 0);
  EXPECT_EQ(pos.step, 5);
  EXPECT_EQ(pos.untrained_epochs, 1);
  EXPECT_EQ(note, "the checkpoint was saved in the middle of epoch 1 by a run with another sample "
                  "order (seed 0; this run has seed 1): continuing with epoch 2; epoch 1 does not "
                  "count as done");

  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr},
                      {.epoch = 1, .batch_in_epoch = 5, .step = 13}, config, 2);
  pos = LoadTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, other_seed, 2, &note);
  EXPECT_EQ(pos.epoch, 2);
  EXPECT_EQ(pos.untrained_epochs, 1);
  EXPECT_EQ(note, "the checkpoint was saved in the middle of epoch 2 by a run with another sample "
                  "order (seed 0; this run has seed 1): it was the last of --epochs=2, so nothing "
                  "is left to train, and it does not count as done; resume with the settings it "
                  "was saved with to finish it");
}

// The same flags over another training set (another --data_dir of the same
// dataset name) is another data order too; an equal size is not.
TEST(TrainStateTest, AnotherTrainingSetSizeContinuesAtTheNextEpoch) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("size");
  TrainComponents saved{model.get(), &opt, nullptr, nullptr};
  saved.train_size = 60000;
  SaveTrainCheckpoint(path, saved, {.epoch = 0, .batch_in_epoch = 5, .step = 5}, config, 2);
  for (const int64_t size : {int64_t{10000}, int64_t{60000}}) {
    TrainComponents loading{model.get(), &opt, nullptr, nullptr};
    loading.train_size = size;
    std::string note;
    const TrainPosition pos = LoadTrainCheckpoint(path, loading, config, 2, &note);
    if (size == 60000) {
      EXPECT_EQ(pos.epoch, 0);
      EXPECT_EQ(pos.batch_in_epoch, 5);
      EXPECT_EQ(note, "");
    } else {
      EXPECT_EQ(pos.epoch, 1);
      EXPECT_EQ(pos.batch_in_epoch, 0);
      EXPECT_NE(note.find("(training samples 60000; this run has training samples 10000)"),
                std::string::npos)
          << note;
      EXPECT_EQ(pos.untrained_epochs, 1);
    }
  }
}

// Rewrites metadata `key` of the checkpoint at `path` to `value`.
void SetMetadata(const std::string& path, const std::string& key, const std::string& value) {
  nn::io::Checkpoint ckpt = nn::io::LoadCheckpoint(path);
  ckpt.metadata[key] = value;
  nn::io::SaveCheckpoint(path, ckpt);
}

// Position values out of range (a file edited by hand, or put together from
// two) are refused in one line that names the key, the value and the file,
// before anything is loaded. A negative epoch_start used to fail in the data
// sampler, without naming the file; a negative epoch trained extra epochs.
TEST(TrainStateTest, PositionOutOfRangeIsRefusedNamingKeyValueAndFile) {
  TrainConfig config;
  config.model = "mlp";
  config.batch_size = 8;
  config.epochs = 2;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  // 300 samples on 2 ranks: 150 per rank, 19 batches of 8.
  auto schedule = std::make_shared<RunSchedule>("cosine", RunEndStep(config, 19));
  nn::optim::LrScheduler scheduler(opt, schedule);
  for (int i = 0; i < 3; ++i) scheduler.Step();
  TrainComponents parts{model.get(), &opt, &scheduler, nullptr};
  parts.train_size = 300;
  parts.schedule = schedule.get();
  parts.batches_per_epoch = 19;
  const std::string path = Path("out_of_range");
  const TrainPosition saved{.epoch = 0, .batch_in_epoch = 3, .step = 3};
  SaveTrainCheckpoint(path, parts, saved, config, 2);
  std::string note;
  EXPECT_EQ(LoadTrainCheckpoint(path, parts, config, 2, &note).step, 3) << note;

  const std::string tail =
      "; the file was not written by this trainer, or changed since; delete it or pass another "
      "--checkpoint to start afresh";
  const struct {
    const char* key;
    const char* value;
    std::string range;
  } cases[] = {
      {"epoch", "-1", "0 or more"},
      {"step", "-2", "0 or more"},
      {"batch_in_epoch", "-1", "0 or more"},
      {"batch_in_epoch", "20", "0 to 19, the batches of its epoch on 2 ranks"},
      {"epoch_start", "-5", "0 or more"},
      {"epoch_start", "301", "0 to 300, its train_size 300"},
      {"epoch_loss_count", "-1", "0 or more"},
      {"train_size", "-300", "0 or more"},
      {"world_size", "0", "1 or more"},
      // Past an int: it wrapped to a negative count, which the sampler
      // refused without naming the file.
      {"world_size", "2147483648", "1 to 2147483647"},
      {"samples_in_epoch", "-1", "0 or more"},
      // Past the epoch's samples (its 19 batches of 8 on 2 ranks cover 304):
      // a run on other ranks skipped the rest of the epoch.
      {"samples_in_epoch", "305",
       "0 to 304, the samples of its epoch's 19 batches on 2 ranks, of its train_size 300"},
      // The scheduler's own count of steps says 3.
      {"step", "4", ""},
  };
  for (const auto& c : cases) {
    SaveTrainCheckpoint(path, parts, saved, config, 2);
    SetMetadata(path, c.key, c.value);
    const std::string expected =
        std::string(c.range.empty() ? "--resume: checkpoint " + path + " has scheduler.step=3, "
                                      "out of range (the step, 4)"
                                    : "--resume: checkpoint " + path + " has " + c.key + "=" +
                                          c.value + ", out of range (" + c.range + ")") +
        tail;
    EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, config, 2, nullptr); }), expected)
        << c.key << "=" << c.value;
  }
}

// An MLP's checkpoint after 3 batches of 8 on 2 ranks of a 300-sample
// training set, saved at Path(name), and the file as loaded (`ckpt`), for a
// test to turn into an older trainer's (keys dropped) and save back.
struct SavedMlpRun {
  explicit SavedMlpRun(const std::string& name) : path(Path(name)) {
    parts.train_size = 300;
    SaveTrainCheckpoint(path, parts, TrainPosition{.epoch = 0, .batch_in_epoch = 3}, config, 2);
    ckpt = nn::io::LoadCheckpoint(path);
  }
  // ckpt with its batch_in_epoch set to `batch`, saved and loaded on 1 rank.
  TrainPosition LoadOnOneRankAtBatch(const std::string& batch, std::string* note) {
    ckpt.metadata["batch_in_epoch"] = batch;
    nn::io::SaveCheckpoint(path, ckpt);
    return LoadTrainCheckpoint(path, parts, config, 1, note);
  }
  static TrainConfig Config() {
    TrainConfig c;
    c.model = "mlp";
    c.batch_size = 8;
    return c;
  }
  TrainConfig config = Config();
  std::shared_ptr<nn::modules::Sequential> model = nn::modules::MakeMlp();
  nn::optim::Sgd opt{model->NamedParameters(), {.lr = config.lr}};
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  std::string path;
  nn::io::Checkpoint ckpt;
};

// A file another program wrote (ddp_hello's checkpoint of the same MLP,
// a safetensors file exported from Python) has none of the trainer's
// metadata. --resume refused it without a way on ("metadata has no
// `epoch`; the file was not written by this trainer"); the line now says
// what to do instead.
TEST(TrainStateTest, ResumeFromAnotherProgramsFileSaysWhatToDoInstead) {
  SavedMlpRun run("another_programs");
  run.ckpt.metadata.clear();
  nn::io::SaveCheckpoint(run.path, run.ckpt);
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(run.path, run.parts, run.config, 2, nullptr); }),
            "--resume: " + run.path + ": metadata has no `epoch`; the file was not written by this "
            "trainer: pass another --checkpoint, or drop --resume to start afresh (the first save then "
            "keeps this file beside it, as <stem>.prev.safetensors)");
}

// An older trainer's file has neither samples_in_epoch nor train_size; the
// samples trained are worked out from the position, and a batch_in_epoch
// so large that the count wraps is refused naming the file and the key. (It
// made a negative start, which the data sampler refused without the file.)
TEST(TrainStateTest, OlderFileWithWrappingBatchInEpochIsRefusedNamingIt) {
  SavedMlpRun run("older_wrapping");
  run.ckpt.metadata.erase("samples_in_epoch");
  run.ckpt.metadata.erase("train_size");
  // 2^62 batches of 8 on 2 ranks: 2^66 samples.
  run.ckpt.metadata["batch_in_epoch"] = "4611686018427387904";
  nn::io::SaveCheckpoint(run.path, run.ckpt);
  // On 1 rank: the order is cut otherwise, and continues after the count.
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(run.path, run.parts, run.config, 1, nullptr); }),
            "--resume: checkpoint " + run.path +
                " has batch_in_epoch=4611686018427387904, out of range (0 to "
                "576460752303423487, so that epoch_start + batch_in_epoch x batch_size x "
                "world_size, the samples of its epoch trained, fits in 64 bits); the file was "
                "not written by this trainer, or changed since; delete it or pass another "
                "--checkpoint to start afresh");

  // Within range, the count is the position's.
  std::string note;
  const TrainPosition pos = run.LoadOnOneRankAtBatch("3", &note);
  EXPECT_EQ(pos.epoch_start, 48);
  EXPECT_EQ(pos.batch_in_epoch, 0);
  EXPECT_NE(note.find("after 48 samples of the epoch's order"), std::string::npos) << note;
}

// A file with samples_in_epoch but no train_size (a trainer between the two
// keys) is checked against this run's training set, which the same seed and
// --train_samples make the saved run's: a samples_in_epoch past the epoch
// is refused naming the file and the key. (It became the start of the
// epoch on other ranks, past its end, so the rest of the epoch was skipped.)
TEST(TrainStateTest, OlderFileWithoutTrainSizeHasItsPositionCheckedAgainstThisRunsSet) {
  SavedMlpRun run("older_no_train_size");
  run.ckpt.metadata.erase("train_size");
  const std::string tail =
      "; the file was not written by this trainer, or changed since; delete it or pass another "
      "--checkpoint to start afresh";
  // 300 samples on 2 ranks: 19 batches of 8, covering 304 positions.
  run.ckpt.metadata["samples_in_epoch"] = "305";
  nn::io::SaveCheckpoint(run.path, run.ckpt);
  for (const int world : {1, 2}) {
    EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(run.path, run.parts, run.config, world, nullptr); }),
              "--resume: checkpoint " + run.path +
                  " has samples_in_epoch=305, out of range (0 to 304, the samples of its epoch's 19 "
                  "batches on 2 ranks, of this run's training set of 300 samples (the file has no "
                  "train_size))" + tail)
        << world << " ranks";
  }
  run.ckpt.metadata["samples_in_epoch"] = "48";
  run.ckpt.metadata["batch_in_epoch"] = "20";
  nn::io::SaveCheckpoint(run.path, run.ckpt);
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(run.path, run.parts, run.config, 1, nullptr); }),
            "--resume: checkpoint " + run.path +
                " has batch_in_epoch=20, out of range (0 to 19, the batches of its epoch on 2 ranks)" + tail);

  // Within range, a run on 1 rank continues after the samples trained.
  std::string note;
  const TrainPosition pos = run.LoadOnOneRankAtBatch("3", &note);
  EXPECT_EQ(pos.epoch_start, 48);
  EXPECT_EQ(pos.batch_in_epoch, 0);
}

// The data order depends on the training set, not on the flag that cut it:
// --train_samples=0 and --train_samples=N over a set of N samples are the
// same samples, and a resume in the middle of an epoch continues it. (The
// flags' text was compared: the epoch was skipped as "another order".)
TEST(TrainStateTest, TrainSamplesFlagOfTheSameSizeContinuesTheEpoch) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  config.train_samples = 0;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  parts.train_size = 600;
  const std::string path = Path("train_samples");
  SaveTrainCheckpoint(path, parts, {.epoch = 0, .batch_in_epoch = 5, .step = 5}, config, 2);
  TrainConfig all = config;
  all.train_samples = 600;
  std::string note;
  const TrainPosition pos = LoadTrainCheckpoint(path, parts, all, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_EQ(pos.epoch, 0);
  EXPECT_EQ(pos.batch_in_epoch, 5);
  EXPECT_EQ(pos.untrained_epochs, 0);
}

// Another dataset of the same image shape fits the model, and used to be
// taken silently at an epoch's end (in the middle of one, as another sample
// order): it is refused, naming both.
TEST(TrainStateTest, AnotherDatasetIsRefusedNamingBoth) {
  TrainConfig config;
  config.model = "mlp";
  config.lr = 0.1;
  config.dataset = "fashion_mnist";
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  parts.train_size = 600;
  const std::string path = Path("dataset");
  TrainConfig mnist = config;
  mnist.dataset = "mnist";
  for (const int64_t batch_in_epoch : {int64_t{0}, int64_t{5}}) {
    SaveTrainCheckpoint(path, parts, {.epoch = 1, .batch_in_epoch = batch_in_epoch, .step = 20},
                        config, 2);
    EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, mnist, 2, nullptr); }),
              "checkpoint " + path + " was saved with --dataset=fashion_mnist and this run has "
              "--dataset=mnist; pass --dataset=fashion_mnist to continue that run, or another "
              "--checkpoint path to start afresh")
        << "batch_in_epoch " << batch_in_epoch;
  }
}

// A restarted job resumes from a checkpoint only when this job saved it
// (the default path is shared by every run of a model and dataset).
TEST(TrainStateTest, RestartResumesOnlyFromThisJobsCheckpoint) {
  EXPECT_EQ(JobFingerprint(""), "");
  EXPECT_EQ(JobFingerprint("token-a"), JobFingerprint("token-a"));
  EXPECT_NE(JobFingerprint("token-a"), JobFingerprint("token-b"));
  EXPECT_EQ(JobFingerprint("token-a").find("token"), std::string::npos);
  // The same token in two ddprun runs (a script's fixed DDP_JOB_TOKEN):
  // two jobs, whose checkpoints a restart tells apart.
  EXPECT_EQ(JobFingerprint("token-a", "run-1"), JobFingerprint("token-a", "run-1"));
  EXPECT_NE(JobFingerprint("token-a", "run-1"), JobFingerprint("token-a", "run-2"));
  EXPECT_NE(JobFingerprint("token-a", "run-1"), JobFingerprint("token-a"));
  // torchrun gives no token: its run id alone names the job.
  EXPECT_NE(JobFingerprint("", "run-1"), "");
  EXPECT_NE(JobFingerprint("", "run-1"), JobFingerprint("", "run-2"));
  EXPECT_NE(JobFingerprint("", "run-1"), JobFingerprint("token-a", "run-1"));

  TrainConfig config;
  config.model = "mlp";
  config.checkpoint = Path("restart");
  config.job = JobFingerprint("token-a");
  std::string note = ResumeAfterRestart(config, 1);
  EXPECT_FALSE(config.resume);
  EXPECT_NE(note.find("restart 1 of the job: no checkpoint at " + config.checkpoint + " yet"),
            std::string::npos) << note;

  nn::Generator g(1);
  auto model = nn::modules::MakeMlp(g);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  SaveTrainCheckpoint(config.checkpoint, {model.get(), &opt, nullptr, nullptr}, {}, config, 2);
  note = ResumeAfterRestart(config, 2);
  EXPECT_TRUE(config.resume) << note;
  EXPECT_NE(note.find("resuming from this run's checkpoint"), std::string::npos) << note;

  config.resume = false;
  config.job = JobFingerprint("token-b");
  note = ResumeAfterRestart(config, 1);
  EXPECT_FALSE(config.resume) << note;
  EXPECT_NE(note.find("is from another run; starting over"), std::string::npos) << note;

  config.checkpoint.clear();
  EXPECT_NE(ResumeAfterRestart(config, 1).find("starting over"), std::string::npos);
  EXPECT_FALSE(config.resume);
}

// This process's virtual memory in bytes (VmSize), or 0 if unknown.
uint64_t VirtualMemoryBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

// A restart whose look at the checkpoint's header runs out of memory (a
// header of 90 MB, with 16 MB of address space to spare) fails as it came:
// it used to refuse the file as unreadable (a UsageError, exit status 2:
// "delete it or pass another --checkpoint"), blaming a file with nothing
// wrong in it. A damaged header is still refused, naming the file.
TEST(TrainStateTest, RestartOutOfMemoryReadingTheHeaderIsNotAnUnreadableCheckpoint) {
  TrainConfig config;
  config.model = "mlp";
  config.checkpoint = Path("restart_no_memory");
  config.job = JobFingerprint("token-a");
  std::filesystem::create_directories(std::filesystem::path(config.checkpoint).parent_path());
  constexpr uint64_t kHeaderBytes = 90'000'000;
  {
    std::ofstream out(config.checkpoint, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((kHeaderBytes >> (8 * i)) & 0xff));
  }
  std::filesystem::resize_file(config.checkpoint, 8 + kHeaderBytes);  // sparse
  const uint64_t in_use = VirtualMemoryBytes();
  ASSERT_GT(in_use, 0u);
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = in_use + (16 << 20);
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &limit), 0);
  std::string outcome;
  try {
    ResumeAfterRestart(config, 1);
    outcome = "no exception";
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  ::setrlimit(RLIMIT_AS, &old_limit);
  EXPECT_EQ(outcome, "std::bad_alloc");
  EXPECT_FALSE(config.resume);

  // The same header, cut short: the file's fault.
  std::filesystem::resize_file(config.checkpoint, 100);
  try {
    ResumeAfterRestart(config, 1);
    ADD_FAILURE() << "a damaged header was not refused";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read the checkpoint at " + config.checkpoint),
              std::string::npos)
        << e.what();
  }
}

// The default run (2 epochs of 469 steps, 938 in all) never reached
// PowerSGD's default start of 1,000 steps and said it compressed anyway.
TEST(TrainStateTest, PowerSgdThatWouldCompressNothingIsRefused) {
  TrainConfig config;
  config.comm_hook = "powersgd";
  EXPECT_EQ(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); }),
            "--comm_hook=powersgd would compress nothing: it starts after --powersgd_start_step=1000 "
            "steps of full all-reduce, and this run ends at step 938 (2 epochs of 469 steps); pass "
            "--powersgd_start_step=937 or less, or another --comm_hook");
  // At 937 the last step (the hook's iteration 937) compresses; at 938 none.
  config.powersgd_start_step = 937;
  EXPECT_EQ(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); }), "");
  config.powersgd_start_step = 938;
  EXPECT_NE(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); }), "");
  config.powersgd_start_step = 0;
  EXPECT_EQ(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); }), "");
  // --max_steps ends the run first; accumulation makes fewer steps.
  config.powersgd_start_step = 1000;
  config.epochs = 5;
  config.max_steps = 1000;
  EXPECT_NE(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); })
                .find("this run ends at step 1,000 (--max_steps=1000)"),
            std::string::npos);
  config.max_steps = 0;
  config.grad_accum_steps = 4;  // 118 steps per epoch, 590 in all
  EXPECT_NE(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); })
                .find("ends at step 590 (5 epochs of 118 steps)"),
            std::string::npos);
  config.comm_hook = "allreduce";
  EXPECT_EQ(UsageErrorOf([&] { CheckPowerSgdStarts(config, 469); }), "");
}

bool NameTakenForTest(const std::string& name) {
  struct stat st;
  return ::lstat(name.c_str(), &st) == 0;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Another run's checkpoint at a fresh run's path is kept beside it under
// the first free name: <stem>.prev, then <stem>.prev.2, ... It used to be
// renamed to <stem>.prev, replacing the file there, which could be a third
// run's checkpoint kept before (two fresh runs, or an unnamed job's restart,
// after it). And it stays at the path too until the save replaces it: it
// used to be moved away first, so a save that failed left nothing there.
TEST(TrainStateTest, AnotherRunsCheckpointIsKeptUnderAFreeNameAndStaysInPlace) {
  EXPECT_EQ(PreviousCheckpointPath("/c/cnn_fashion_mnist.safetensors"),
            "/c/cnn_fashion_mnist.prev.safetensors");
  EXPECT_EQ(PreviousCheckpointPath("/c/ckpt"), "/c/ckpt.prev");
  const std::string path = Path("keep_prev");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  const std::string previous = PreviousCheckpointPath(path);
  const std::string second = Path("keep_prev.prev.2");
  const std::string third = Path("keep_prev.prev.3");
  std::ofstream(previous) << "older";
  std::ofstream(path) << "another run's";
  EXPECT_EQ(KeepAsPreviousCheckpoint(path), second);
  EXPECT_EQ(ReadAll(previous), "older") << "a checkpoint kept before was replaced";
  EXPECT_EQ(ReadAll(second), "another run's");
  EXPECT_EQ(ReadAll(path), "another run's") << "the file left its path before the save";
  EXPECT_EQ(KeepAsPreviousCheckpoint(path), third);
  EXPECT_EQ(ReadAll(second), "another run's");
  EXPECT_EQ(ReadAll(third), "another run's");

  std::filesystem::remove(path);
  const std::string msg = UsageErrorOf([&] { KeepAsPreviousCheckpoint(path); });
  EXPECT_EQ(msg.rfind("cannot keep another run's checkpoint " + path + " as " + previous + ": ", 0),
            0u)
      << msg;
  EXPECT_EQ(ReadAll(previous), "older");
}

// A checkpoint path that is a symbolic link: the save writes through it, so
// the file kept is the one it leads to, not the link (whose second name
// would lead to the new file, losing the other run's checkpoint).
TEST(TrainStateTest, ACheckpointBehindASymlinkIsKeptAsTheFileItLeadsTo) {
  const std::string path = Path("keep_link");
  const std::string target = Path("keep_link_target");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(target) << "another run's";
  std::filesystem::create_symlink(std::filesystem::path(target).filename(), path);
  const std::string kept = KeepAsPreviousCheckpoint(path);
  EXPECT_EQ(kept, PreviousCheckpointPath(path));
  EXPECT_FALSE(std::filesystem::is_symlink(kept));
  {
    nn::io::AtomicFileWriter out(path);
    const std::string bytes = "this run's";
    out.Write(bytes.data(), bytes.size());
    out.Commit();
  }
  EXPECT_TRUE(std::filesystem::is_symlink(path));
  EXPECT_EQ(ReadAll(target), "this run's");
  EXPECT_EQ(ReadAll(kept), "another run's");
}

// A checkpoint path that is a symbolic link to a file on another
// filesystem (/dev/shm here): no hard link of that file can be made beside
// the link (EXDEV), so it is kept beside itself, and the link stays a link
// that the save writes through. The link itself used to be renamed to
// <stem>.prev: the old file was kept, but the save then made a plain file
// at the path, on the link's filesystem, instead of writing where the link
// led.
TEST(TrainStateTest, ACheckpointBehindASymlinkToAnotherFilesystemIsKeptBesideTheFileItLeadsTo) {
  const std::string path = Path("keep_link_elsewhere");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  // A folder on another filesystem than TEST_TMPDIR's: /dev/shm (tmpfs)
  // where there is one.
  struct stat here{};
  ASSERT_EQ(::stat(std::filesystem::path(path).parent_path().c_str(), &here), 0);
  std::string dir;
  std::error_code ec;
  for (const char* base : {"/dev/shm", "/run/shm", "/tmp", "/var/tmp"}) {
    struct stat there{};
    if (::stat(base, &there) != 0 || there.st_dev == here.st_dev || ::access(base, W_OK) != 0) continue;
    dir = std::string(base) + "/ddp_train_state_test_" + std::to_string(::getpid());
    if (std::filesystem::create_directories(dir, ec) && !ec) break;
    dir.clear();
  }
  ASSERT_FALSE(dir.empty()) << "this test needs a writable folder on another filesystem than TEST_TMPDIR "
                               "(it tried /dev/shm, /run/shm, /tmp and /var/tmp)";
  const std::shared_ptr<void> cleanup(nullptr, [&dir](void*) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  });
  const std::string target = dir + "/ckpt.safetensors";
  std::ofstream(target) << "another run's";
  std::filesystem::create_symlink(target, path);
  const std::string beside_target = PreviousCheckpointPath(target);
  EXPECT_EQ(FreePreviousCheckpointPath(path), beside_target);

  const std::string kept = KeepAsPreviousCheckpoint(path);
  EXPECT_EQ(kept, beside_target);
  EXPECT_FALSE(NameTakenForTest(PreviousCheckpointPath(path))) << "the link was moved";
  EXPECT_TRUE(std::filesystem::is_symlink(path));
  EXPECT_EQ(ReadAll(path), "another run's") << "the file left its path before the save";
  EXPECT_EQ(ReadAll(kept), "another run's");
  // A save that failed: the kept name goes, the file is as it was.
  EXPECT_TRUE(ForgetKeptCheckpoint(path, kept));
  EXPECT_FALSE(std::filesystem::exists(kept));
  EXPECT_EQ(ReadAll(target), "another run's");

  EXPECT_EQ(KeepAsPreviousCheckpoint(path), kept);
  {
    nn::io::AtomicFileWriter out(path);
    const std::string bytes = "this run's";
    out.Write(bytes.data(), bytes.size());
    out.Commit();
  }
  EXPECT_TRUE(std::filesystem::is_symlink(path)) << "the save made a plain file at the link's place";
  EXPECT_EQ(ReadAll(target), "this run's");
  EXPECT_EQ(ReadAll(kept), "another run's");
  EXPECT_FALSE(ForgetKeptCheckpoint(path, kept));
  // A later run keeps this one under the next free name beside the target.
  EXPECT_EQ(KeepAsPreviousCheckpoint(path), PreviousCheckpointPath(target, 2));
  EXPECT_EQ(ReadAll(PreviousCheckpointPath(target, 2)), "this run's");
  EXPECT_EQ(ReadAll(kept), "another run's");
}

// After a save that failed, the file kept is still at the path: its second
// name goes, leaving it as it was. After one that replaced it (and then
// failed to sync the folder, say) the kept name is all there is of it.
TEST(TrainStateTest, AKeptNameGoesOnlyWhileTheFileIsStillAtThePath) {
  EXPECT_EQ(PreviousCheckpointPath("/c/cnn_fashion_mnist.safetensors", 2),
            "/c/cnn_fashion_mnist.prev.2.safetensors");
  const std::string path = Path("forget_prev");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(PreviousCheckpointPath(path)) << "older";
  std::ofstream(path) << "another run's";
  const std::string second = PreviousCheckpointPath(path, 2);
  EXPECT_EQ(FreePreviousCheckpointPath(path), second);
  EXPECT_EQ(KeepAsPreviousCheckpoint(path), second);
  EXPECT_EQ(FreePreviousCheckpointPath(path), PreviousCheckpointPath(path, 3));
  EXPECT_TRUE(ForgetKeptCheckpoint(path, second));
  EXPECT_FALSE(std::filesystem::exists(second));
  EXPECT_EQ(ReadAll(path), "another run's");
  EXPECT_EQ(ReadAll(PreviousCheckpointPath(path)), "older");

  EXPECT_EQ(KeepAsPreviousCheckpoint(path), second);
  std::ofstream(path + ".new") << "this run's";
  std::filesystem::rename(path + ".new", path);
  EXPECT_FALSE(ForgetKeptCheckpoint(path, second));
  EXPECT_EQ(ReadAll(second), "another run's");
}

// A safetensors file that the trainer did not write (weights exported from
// Python, say) at a fresh run's --checkpoint is kept, as another run's
// checkpoint and an unreadable file are. It used to count as nothing to
// keep, and the first save replaced it without a word.
TEST(TrainStateTest, ASafetensorsFileTheTrainerDidNotWriteIsKeptLikeAnotherRunsCheckpoint) {
  const std::string path = Path("exported_weights");
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  nn::io::SaveTensors(path, {{"fc.weight", nn::Zeros({2, 3})}}, {{"source", "python"}});
  EXPECT_TRUE(IsAnotherRunsCheckpoint(path, JobFingerprint("token-a")));
  EXPECT_TRUE(IsAnotherRunsCheckpoint(path, ""));

  const std::string unreadable = Path("unreadable");
  std::ofstream(unreadable) << "not safetensors";
  EXPECT_TRUE(IsAnotherRunsCheckpoint(unreadable, JobFingerprint("token-a")));
  EXPECT_FALSE(IsAnotherRunsCheckpoint(Path("nothing_there"), JobFingerprint("token-a")));

  // This job's own checkpoint is not kept; another job's, or any when the
  // job has no name, is.
  TrainConfig config;
  config.model = "mlp";
  config.job = JobFingerprint("token-a");
  const std::string own = Path("own");
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  SaveTrainCheckpoint(own, {model.get(), &opt, nullptr, nullptr}, {}, config, 2);
  EXPECT_FALSE(IsAnotherRunsCheckpoint(own, config.job));
  EXPECT_TRUE(IsAnotherRunsCheckpoint(own, JobFingerprint("token-b")));
  EXPECT_TRUE(IsAnotherRunsCheckpoint(own, ""));
}

// What a kept file is, for the start's note and the save's lines: a file
// that is not safetensors at all (a PyTorch .pt, a text file), or one the
// host failed to read (here a symbolic link loop: ELOOP), was called
// "another run's checkpoint", and the note offered --resume, which refuses
// the first. Each is told apart now.
TEST(TrainStateTest, KeptFileKindTellsAFileThatIsNotSafetensorsFromOneTheHostCannotRead) {
  const std::string text = Path("kind_text");
  std::filesystem::create_directories(std::filesystem::path(text).parent_path());
  std::ofstream(text) << "not safetensors";
  EXPECT_TRUE(IsAnotherRunsCheckpoint(text, JobFingerprint("token-a")));
  EXPECT_EQ(KeptFileKind(text), "a file that does not read as a safetensors file");

  const std::string loop = Path("kind_loop");
  std::filesystem::remove(loop);
  std::filesystem::create_symlink(loop, loop);
  EXPECT_TRUE(IsAnotherRunsCheckpoint(loop, JobFingerprint("token-a")));
  EXPECT_EQ(KeptFileKind(loop), "a file whose header cannot be read now");

  const std::string exported = Path("kind_exported");
  nn::io::SaveTensors(exported, {{"fc.weight", nn::Zeros({2, 3})}}, {{"source", "python"}});
  EXPECT_EQ(KeptFileKind(exported), "a file this trainer did not write");

  TrainConfig config;
  config.model = "mlp";
  const std::string own = Path("kind_own");
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  SaveTrainCheckpoint(own, {model.get(), &opt, nullptr, nullptr}, {}, config, 2);
  EXPECT_EQ(KeptFileKind(own), "another run's checkpoint");
}

// A checkpoint of a cosine schedule from lr 0.05, saved at the end of the
// first of 2 epochs of 4 steps on 2 ranks.
std::string SaveCosineRun(const std::string& name, TrainConfig& config) {
  config.model = "mlp";
  config.epochs = 2;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  nn::optim::LrScheduler scheduler(opt, nn::optim::CosineSchedule(8));
  for (int i = 0; i < 4; ++i) scheduler.Step();
  const std::string path = Path(name);
  SaveTrainCheckpoint(path, {model.get(), &opt, &scheduler, nullptr},
                      {.epoch = 1, .batch_in_epoch = 0, .step = 4}, config, 2);
  return path;
}

// A resumed schedule continues the saved one or nothing: another
// --scheduler (none too) or another --lr, which the saved base rate used to
// override silently, is refused naming the flag and both values, and
// nothing is loaded.
TEST(TrainStateTest, AnotherSchedulerOrRateIsRefusedNamingBothValues) {
  TrainConfig saved;
  const std::string path = SaveCosineRun("schedule_kind", saved);
  auto model = nn::modules::MakeMlp();
  for (const std::string scheduler : {"step", "none"}) {
    TrainConfig config = saved;
    config.scheduler = scheduler;
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    std::unique_ptr<nn::optim::LrScheduler> step;
    if (scheduler == "step") step = std::make_unique<nn::optim::LrScheduler>(opt, nn::optim::StepSchedule(2));
    EXPECT_EQ(UsageErrorOf([&] {
                LoadTrainCheckpoint(path, {model.get(), &opt, step.get(), nullptr}, config, 2, nullptr);
              }),
              "checkpoint " + path + " was saved with --scheduler=cosine and this run has --scheduler=" +
                  scheduler + "; pass --scheduler=cosine to continue that run, or another "
                  "--checkpoint path to start afresh");
    if (step) {
      EXPECT_EQ(step->step_count(), 0) << "a refused checkpoint was loaded";
    }
  }
  TrainConfig config = saved;
  config.lr = 0.1;
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  nn::optim::LrScheduler cosine(opt, nn::optim::CosineSchedule(8));
  EXPECT_EQ(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {model.get(), &opt, &cosine, nullptr}, config, 2, nullptr);
            }),
            "checkpoint " + path + " was saved with --lr=0.05 and this run has --lr=0.1; pass "
            "--lr=0.05 to continue that run, or another --checkpoint path to start afresh");
  EXPECT_EQ(cosine.step_count(), 0);
  EXPECT_EQ(cosine.base_lr(), 0.1);
  // Rates that print alike at 6 digits are told apart.
  config.lr = 0.0500001;
  EXPECT_NE(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {model.get(), &opt, &cosine, nullptr}, config, 2, nullptr);
            }).find("was saved with --lr=0.05 and this run has --lr=0.0500001;"),
            std::string::npos);
}

// The UsageError of loading SaveCosineRun's checkpoint at `path` into
// `model` with an SGD and cosine schedule made from `config` ("" if none).
std::string CosineRunLoadError(const std::string& path, nn::modules::Module& model, const TrainConfig& config) {
  nn::optim::Sgd opt(model.NamedParameters(), {.lr = config.lr});
  nn::optim::LrScheduler cosine(opt, nn::optim::CosineSchedule(8));
  return UsageErrorOf([&] { LoadTrainCheckpoint(path, {&model, &opt, &cosine, nullptr}, config, 2, nullptr); });
}

// Another --momentum or --weight_decay is refused the same way: the saved
// momentum buffers would be dropped (0) or new ones started, the update
// changed; the run would silently not continue the saved one.
TEST(TrainStateTest, AnotherMomentumOrWeightDecayIsRefusedNamingBothValues) {
  TrainConfig saved;
  saved.momentum = 0.9;
  saved.weight_decay = 1e-4;
  const std::string path = SaveCosineRun("optimizer_settings", saved);
  auto model = nn::modules::MakeMlp();
  auto error = [&](const TrainConfig& config) { return CosineRunLoadError(path, *model, config); };
  TrainConfig config = saved;
  config.momentum = 0.5;
  EXPECT_EQ(error(config), "checkpoint " + path + " was saved with --momentum=0.9 and this run has --momentum=0.5; "
                           "pass --momentum=0.9 to continue that run, or another --checkpoint path to start afresh");
  config = saved;
  config.weight_decay = 0;
  EXPECT_EQ(error(config), "checkpoint " + path + " was saved with --weight_decay=0.0001 and this run has "
                           "--weight_decay=0; pass --weight_decay=0.0001 to continue that run, or another "
                           "--checkpoint path to start afresh");
  EXPECT_EQ(error(saved), "");
}

// A saved lr, momentum or weight_decay that is not a finite number (or
// starts with white space, which ExactDouble never writes) is refused as a
// file this trainer did not write, quoting the value; "nan" was read as a
// number, and the refusal advised "pass --lr=nan", which the flags refuse.
TEST(TrainStateTest, ASavedOptimizerSettingThatIsNotAFiniteNumberIsRefusedQuotingIt) {
  TrainConfig saved;
  saved.momentum = 0.9;
  saved.weight_decay = 1e-4;
  const std::string path = SaveCosineRun("not_finite", saved);
  auto model = nn::modules::MakeMlp();
  const nn::io::Checkpoint good = nn::io::LoadCheckpoint(path);
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"lr", "nan"}, {"momentum", "inf"},
                                                        {"weight_decay", " " + good.metadata.at("weight_decay")}}) {
    nn::io::Checkpoint bad = good;
    bad.metadata[key] = value;
    nn::io::SaveCheckpoint(path, bad);
    const std::string error = CosineRunLoadError(path, *model, saved);
    const std::string quoted = "'" + value + "'";
    EXPECT_EQ(error.rfind("--resume: checkpoint " + path + " has no valid " + key + " (not ", 0), 0) << error;
    EXPECT_NE(error.find(quoted + "); the file was not written by this trainer"), std::string::npos) << error;
  }
}

// --decay_norm_and_bias decides the optimizer's groups: another value is
// refused naming both, and a checkpoint from before the flag was recorded
// counts as true (every parameter decayed, as trainers then did).
TEST(TrainStateTest, AnotherDecayNormAndBiasIsRefusedAndAnOlderCheckpointCountsAsTrue) {
  TrainConfig saved;
  saved.weight_decay = 1e-4;
  const std::string path = SaveCosineRun("decay_norm_and_bias", saved);
  EXPECT_EQ(nn::io::LoadCheckpoint(path).metadata.at("decay_norm_and_bias"), "true");
  auto model = nn::modules::MakeMlp();
  auto error = [&](const TrainConfig& config) { return CosineRunLoadError(path, *model, config); };
  TrainConfig config = saved;
  config.decay_norm_and_bias = false;
  const std::string refused = "checkpoint " + path +
                              " was saved with --decay_norm_and_bias=true and this run has "
                              "--decay_norm_and_bias=false; pass --decay_norm_and_bias=true to continue "
                              "that run, or another --checkpoint path to start afresh";
  EXPECT_EQ(error(config), refused);
  EXPECT_EQ(error(saved), "");

  nn::io::Checkpoint older = nn::io::LoadCheckpoint(path);
  older.metadata.erase("decay_norm_and_bias");
  nn::io::SaveCheckpoint(path, older);
  EXPECT_EQ(error(saved), "");
  EXPECT_EQ(error(config), refused);

  older.metadata["decay_norm_and_bias"] = "maybe";
  nn::io::SaveCheckpoint(path, older);
  EXPECT_EQ(error(saved), "--resume: checkpoint " + path +
                              " has no valid decay_norm_and_bias; the file was not written by this "
                              "trainer: pass another --checkpoint, or drop --resume to start afresh (the "
                              "first save then keeps this file beside it, as <stem>.prev.safetensors)");
}

// Another --comm_hook or --sync_bn changes how the run goes on (gradient
// compression; BatchNorm statistics per rank or across ranks) but not what
// it continues from: the resume goes ahead, with a note naming both values
// (it used to be silent). A checkpoint from before they were recorded loads
// without one.
TEST(TrainStateTest, AnotherCommHookOrSyncBnLoadsWithANoteNamingBothValues) {
  TrainConfig saved;
  const std::string path = SaveCosineRun("comm_settings", saved);
  auto model = nn::modules::MakeMlp();
  auto note_of = [&](const TrainConfig& config) {
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
    nn::optim::LrScheduler cosine(opt, nn::optim::CosineSchedule(8));
    std::string note = "unset";
    LoadTrainCheckpoint(path, {model.get(), &opt, &cosine, nullptr}, config, 2, &note);
    return note;
  };
  EXPECT_EQ(note_of(saved), "");
  TrainConfig config = saved;
  config.comm_hook = "fp16";
  config.sync_bn = true;
  EXPECT_EQ(note_of(config),
            "checkpoint " + path + " was saved with --comm_hook=allreduce and this run has "
            "--comm_hook=fp16, which it goes on with; checkpoint " + path + " was saved with "
            "--sync_bn=false and this run has --sync_bn=true, which it goes on with");
  nn::io::Checkpoint older = nn::io::LoadCheckpoint(path);
  older.metadata.erase("comm_hook");
  older.metadata.erase("sync_bn");
  nn::io::SaveCheckpoint(path, older);
  EXPECT_EQ(note_of(config), "");
}

// Another --amp is refused naming both values, though the model's tensors
// match (on a GPU they are f32 under every --amp): fp16's loss scaler state
// would be dropped, or the precision changed silently.
TEST(TrainStateTest, AnotherAmpIsRefusedNamingBothValues) {
  TrainConfig saved;
  saved.amp = "fp16";
  const std::string path = SaveCosineRun("amp", saved);
  auto model = nn::modules::MakeMlp();
  TrainConfig config = saved;
  config.amp = "off";
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  nn::optim::LrScheduler cosine(opt, nn::optim::CosineSchedule(8));
  EXPECT_EQ(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {model.get(), &opt, &cosine, nullptr}, config, 2, nullptr);
            }),
            "checkpoint " + path + " was saved with --amp=fp16 and this run has --amp=off; pass "
            "--amp=fp16 to continue that run, or another --checkpoint path to start afresh");
  EXPECT_EQ(cosine.step_count(), 0) << "a refused checkpoint was loaded";
}

// One SGD step of a model whose parameters are `dtype`, on inputs of it.
void TrainOneStepIn(nn::modules::Module& model, nn::optim::Optimizer& opt, nn::DType dtype) {
  nn::Generator gen(7);
  const nn::Tensor x = nn::Randn({4, 1, 28, 28}, {}, gen).To(dtype);
  nn::Backward(nn::ops::Sum(model.Forward(x)));
  opt.Step();
  opt.ZeroGrad();
}

// The optimizer state entry `key` of `opt`, as f32 values.
std::vector<float> StateOf(const nn::optim::Optimizer& opt, const std::string& key) {
  for (const auto& [k, t] : opt.StateDict()) {
    if (k == key) return t.To(nn::DType::kFloat32).ToVector<float>();
  }
  return {};
}

// A GPU run with --amp keeps an f32 model (autocast computes in 16 bits); a
// CPU run with the same --amp has a 16-bit model. A checkpoint of either
// resumes on the other: the model state is converted, and the f32 values
// become the optimizer's master copies, so nothing is rounded away.
TEST(TrainStateTest, AmpCheckpointOfTheGpuResumesOnTheCpu) {
  TrainConfig gpu;
  gpu.model = "mlp";
  gpu.lr = 0.1;
  gpu.amp = "bf16";
  gpu.device = "cuda";
  nn::Generator g1(1), g2(2);
  auto model = nn::modules::MakeMlp(g1);  // f32, as on CUDA
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  const std::string path = Path("amp_gpu");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {.step = 1}, gpu, 1);

  TrainConfig cpu = gpu;
  cpu.device = "cpu";
  auto other = nn::modules::MakeMlp(g2);
  other->To(nn::DType::kBFloat16);  // what --amp=bf16 makes of it on the CPU
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  std::string note;
  EXPECT_EQ(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {other.get(), &other_opt, nullptr, nullptr}, cpu, 1, &note);
            }),
            "");
  const auto a = model->GetStateDict();
  const auto b = other->GetStateDict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].second.dtype(), nn::DType::kBFloat16) << b[i].first;
    EXPECT_EQ(a[i].second.To(nn::DType::kBFloat16).To(nn::DType::kFloat32).ToVector<float>(),
              b[i].second.To(nn::DType::kFloat32).ToVector<float>())
        << b[i].first;
    // The f32 weights are the masters, exactly; the momentum came along.
    EXPECT_EQ(StateOf(other_opt, "state." + a[i].first + ".master"), a[i].second.ToVector<float>())
        << a[i].first;
    const std::string momentum = "state." + a[i].first + ".momentum_buffer";
    EXPECT_FALSE(StateOf(other_opt, momentum).empty()) << momentum;
  }
}

TEST(TrainStateTest, AmpCheckpointOfTheCpuResumesOnTheGpuFromItsMasters) {
  TrainConfig cpu;
  cpu.model = "mlp";
  cpu.lr = 0.1;
  cpu.amp = "bf16";
  cpu.device = "cpu";
  nn::Generator g1(1), g2(2);
  auto model = nn::modules::MakeMlp(g1);
  model->To(nn::DType::kBFloat16);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStepIn(*model, opt, nn::DType::kBFloat16);
  const std::string path = Path("amp_cpu");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {.step = 1}, cpu, 1);

  TrainConfig gpu = cpu;
  gpu.device = "cuda";
  auto other = nn::modules::MakeMlp(g2);  // f32, as on CUDA (tested on the CPU)
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {other.get(), &other_opt, nullptr, nullptr}, gpu, 1, nullptr);
            }),
            "");
  for (const auto& [name, p] : other->NamedParameters()) {
    EXPECT_EQ(p.dtype(), nn::DType::kFloat32) << name;
    const std::vector<float> master = StateOf(opt, "state." + name + ".master");
    ASSERT_FALSE(master.empty()) << name;
    EXPECT_EQ(p.ToVector<float>(), master) << name;
    EXPECT_TRUE(StateOf(other_opt, "state." + name + ".master").empty()) << name;
  }
}

// Removes metadata `key` of the checkpoint at `path`, as an older trainer
// that did not write it would have.
void EraseMetadata(const std::string& path, const std::string& key) {
  nn::io::Checkpoint ckpt = nn::io::LoadCheckpoint(path);
  ckpt.metadata.erase(key);
  nn::io::SaveCheckpoint(path, ckpt);
}

// An older trainer's checkpoint (no model dtype recorded) loads as it did
// on the same device, and on the other one is refused naming --device,
// not "pass the same flags" when they are the same.
TEST(TrainStateTest, OlderAmpCheckpointLoadsOnItsDeviceAndNamesDeviceOnTheOther) {
  TrainConfig gpu;
  gpu.model = "mlp";
  gpu.lr = 0.1;
  gpu.amp = "bf16";
  gpu.device = "cuda";
  nn::Generator g1(1), g2(2), g3(3);
  auto model = nn::modules::MakeMlp(g1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  TrainOneStep(*model, opt);
  const std::string path = Path("amp_old");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {.step = 1}, gpu, 1);
  EraseMetadata(path, "model_dtype");
  EraseMetadata(path, "device");

  auto same = nn::modules::MakeMlp(g2);
  nn::optim::Sgd same_opt(same->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {same.get(), &same_opt, nullptr, nullptr}, gpu, 1, nullptr);
            }),
            "");
  EXPECT_EQ(same->GetStateDict()[0].second.ToVector<float>(),
            model->GetStateDict()[0].second.ToVector<float>());

  TrainConfig cpu = gpu;
  cpu.device = "cpu";
  auto other = nn::modules::MakeMlp(g3);
  other->To(nn::DType::kBFloat16);
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  const std::string error = UsageErrorOf([&] {
    LoadTrainCheckpoint(path, {other.get(), &other_opt, nullptr, nullptr}, cpu, 1, nullptr);
  });
  EXPECT_NE(error.find("does not match --model=mlp --amp=bf16"), std::string::npos) << error;
  EXPECT_NE(error.find("on the other --device than this run's --device=cpu"), std::string::npos) << error;
  EXPECT_NE(error.find("resume it with the --device it was saved with"), std::string::npos) << error;
  EXPECT_EQ(error.find("pass the same flags"), std::string::npos) << error;
}

// The state of an MLP run of `config` (4 batches an epoch, SGD) under a
// cosine schedule that ends where that run ends, stepped `steps` times.
struct CosineMlpRun {
  CosineMlpRun(const TrainConfig& config, int steps)
      : model(nn::modules::MakeMlp()),
        opt(model->NamedParameters(), {.lr = config.lr}),
        schedule(std::make_shared<RunSchedule>("cosine", RunEndStep(config, 4))),
        scheduler(opt, schedule) {
    for (int i = 0; i < steps; ++i) scheduler.Step();
    parts.schedule = schedule.get();
    parts.batches_per_epoch = 4;
  }
  std::shared_ptr<nn::modules::Module> model;
  nn::optim::Sgd opt;
  std::shared_ptr<RunSchedule> schedule;
  nn::optim::LrScheduler scheduler;
  TrainComponents parts{model.get(), &opt, &scheduler, nullptr};
};

// The same run resumed on 1 rank instead of 2 takes twice the steps per
// epoch: the schedule ends where this run ends (step 4 + 8), not at the 16
// steps this run's flags alone give, where it never reaches 0.
TEST(TrainStateTest, ScheduleEndsWhereTheRunEndsOnAnotherNumberOfRanks) {
  TrainConfig config;
  config.model = "mlp";
  config.epochs = 2;
  CosineMlpRun run(config, 4);
  auto& [model, opt, schedule, scheduler, parts] = run;
  EXPECT_EQ(schedule->steps(), 8);
  const std::string path = Path("horizon");
  SaveTrainCheckpoint(path, parts, {.epoch = 1, .batch_in_epoch = 0, .step = 4}, config, 2);

  // The same ranks: the same schedule, no note.
  std::string note = "stale";
  LoadTrainCheckpoint(path, parts, config, 2, &note);
  EXPECT_EQ(note, "");
  EXPECT_EQ(schedule->steps(), 8);

  nn::optim::Sgd one_opt(model->NamedParameters(), {.lr = config.lr});
  auto one_schedule = std::make_shared<RunSchedule>("cosine", RunEndStep(config, 8));
  EXPECT_EQ(one_schedule->steps(), 16);
  nn::optim::LrScheduler one_scheduler(one_opt, one_schedule);
  TrainComponents one{model.get(), &one_opt, &one_scheduler, nullptr};
  one.schedule = one_schedule.get();
  one.batches_per_epoch = 8;
  const TrainPosition pos = LoadTrainCheckpoint(path, one, config, 1, &note);
  EXPECT_EQ(pos.step, 4);
  EXPECT_EQ(one_schedule->steps(), 12);
  EXPECT_EQ(note, "the cosine schedule now ends at step 12, where this run ends (after --epochs=2 "
                  "at 8 steps per epoch), instead of the checkpoint's step 8");
  EXPECT_DOUBLE_EQ(one_opt.lr(), 0.05 * (1 + std::cos(M_PI * 4 / 12)) / 2);
  for (int i = 0; i < 8; ++i) one_scheduler.Step();
  EXPECT_EQ(one_opt.lr(), 0.0) << "the schedule did not end with the run";
}

// A run stopped by --max_steps=6 and resumed without it: its cosine
// schedule ended at step 6; ending it at step 8 instead would raise the
// rate again. Refused, naming the flag and both values; a change that
// leaves the end where it was (--max_steps still binds) is not.
TEST(TrainStateTest, RunLengthThatMovesTheScheduleIsRefused) {
  TrainConfig config;
  config.model = "mlp";
  config.epochs = 2;
  config.max_steps = 6;
  CosineMlpRun run(config, 6);  // at step 6, as the position
  auto& [model, opt, schedule, scheduler, parts] = run;
  EXPECT_EQ(schedule->steps(), 6);
  const std::string path = Path("run_length");
  SaveTrainCheckpoint(path, parts, {.epoch = 1, .batch_in_epoch = 2, .step = 6}, config, 2);

  TrainConfig longer = config;
  longer.max_steps = 0;
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, longer, 2, nullptr); }),
            "the cosine schedule of checkpoint " + path + " ends at step 6, as --max_steps=6 set "
            "it, and this run's --max_steps=0 would end it at step 8; pass --max_steps=6 to "
            "continue that run, or another --checkpoint path to start afresh");
  longer.epochs = 3;
  EXPECT_NE(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, longer, 2, nullptr); })
                .find("as --max_steps=6 set it, and this run's --epochs=3 --max_steps=0 "
                      "would end it at step 12; pass --epochs=2 --max_steps=6 to"),
            std::string::npos);
  EXPECT_EQ(schedule->steps(), 6) << "a refused checkpoint changed the schedule";
  TrainConfig capped = config;
  capped.epochs = 5;
  EXPECT_EQ(LoadTrainCheckpoint(path, parts, capped, 2, nullptr).step, 6);
  EXPECT_EQ(schedule->steps(), 6);
}

// A run that ended after all its epochs, resumed with a --max_steps that
// would end its schedule early: the refusal named --max_steps=0 (no
// limit) as what set the end, which --epochs did.
TEST(TrainStateTest, RunLengthRefusalNamesTheFlagThatSetTheEnd) {
  TrainConfig config;
  config.model = "mlp";
  config.epochs = 2;
  CosineMlpRun run(config, 3);
  auto& [model, opt, schedule, scheduler, parts] = run;
  EXPECT_EQ(schedule->steps(), 8);
  const std::string path = Path("run_length_epochs");
  SaveTrainCheckpoint(path, parts, {.epoch = 0, .batch_in_epoch = 3, .step = 3}, config, 2);

  TrainConfig shorter = config;
  shorter.max_steps = 5;
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, shorter, 2, nullptr); }),
            "the cosine schedule of checkpoint " + path + " ends at step 8, as --epochs=2 set it, "
            "and this run's --max_steps=5 would end it at step 5; pass --max_steps=0 to continue "
            "that run, or another --checkpoint path to start afresh");
}

// Checkpoints from before the schedule was recorded load as they always
// did (the horizon from this run's flags, the saved base rate), with a
// note saying so.
TEST(TrainStateTest, CheckpointWithoutTheRecordedScheduleLoadsWithANote) {
  TrainConfig saved;
  const std::string path = SaveCosineRun("older", saved);
  nn::io::Checkpoint older = nn::io::LoadCheckpoint(path);
  for (const char* key : {"lr", "schedule_steps", "epochs", "max_steps"}) older.metadata.erase(key);
  nn::io::SaveCheckpoint(path, older);

  TrainConfig config = saved;
  config.lr = 0.1;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  auto schedule = std::make_shared<RunSchedule>("cosine", RunEndStep(config, 8));
  nn::optim::LrScheduler scheduler(opt, schedule);
  TrainComponents parts{model.get(), &opt, &scheduler, nullptr};
  parts.schedule = schedule.get();
  parts.batches_per_epoch = 8;
  std::string note;
  EXPECT_EQ(LoadTrainCheckpoint(path, parts, config, 1, &note).step, 4);
  EXPECT_EQ(schedule->steps(), 16);
  EXPECT_EQ(scheduler.base_lr(), 0.05);
  EXPECT_EQ(note, "checkpoint " + path + " was saved by an older trainer, which did not record "
                  "where its schedule ends: the cosine schedule ends at step 16, as this run's "
                  "flags set it; checkpoint " + path + " was saved by an older trainer, which did "
                  "not record --lr: the run continues from its rate 0.05, not --lr=0.1");
}

// Each --scheduler kind follows its flags, in optimizer steps; onecycle
// peaks at --lr and runs over the horizon; plateau and none are no
// RunSchedule.
TEST(TrainStateTest, RunScheduleKindsFollowTheirFlags) {
  TrainConfig c;
  c.scheduler = "step";
  c.lr_gamma = 0.5;
  EXPECT_DOUBLE_EQ(RunSchedule(c, 9).Lr(1.0, 2), 1.0);
  EXPECT_DOUBLE_EQ(RunSchedule(c, 9).Lr(1.0, 3), 0.5);
  EXPECT_DOUBLE_EQ(RunSchedule("step", 9).Lr(1.0, 3), 0.1) << "step's default gamma changed";
  c.scheduler = "multistep";
  c.lr_milestones = {2, 5};
  const RunSchedule multistep(c, 100);
  EXPECT_DOUBLE_EQ(multistep.Lr(1.0, 1), 1.0);
  EXPECT_DOUBLE_EQ(multistep.Lr(1.0, 2), 0.5);
  EXPECT_DOUBLE_EQ(multistep.Lr(1.0, 5), 0.25);
  EXPECT_FALSE(multistep.uses_horizon());
  c = TrainConfig{};
  c.scheduler = "exponential";
  c.lr_gamma = 0.9;
  EXPECT_DOUBLE_EQ(RunSchedule(c, 100).Lr(1.0, 2), 0.81);
  c = TrainConfig{};
  c.scheduler = "warm_restarts";
  c.lr_t0 = 4;
  c.lr_t_mult = 2;
  const RunSchedule restarts(c, 100);
  EXPECT_DOUBLE_EQ(restarts.Lr(1.0, 2), 0.5);
  EXPECT_DOUBLE_EQ(restarts.Lr(1.0, 4), 1.0) << "no restart after --lr_t0 steps";
  EXPECT_DOUBLE_EQ(restarts.Lr(1.0, 8), 0.5) << "the second cycle is not twice as long";
  c = TrainConfig{};
  c.scheduler = "onecycle";
  c.lr = 0.05;
  RunSchedule onecycle(c, 10);
  EXPECT_TRUE(onecycle.uses_horizon());
  EXPECT_DOUBLE_EQ(onecycle.Lr(123.0, 0), 0.05 / 25);
  EXPECT_DOUBLE_EQ(onecycle.Lr(123.0, 2), 0.05);  // the peak, at 30% of the steps less one
  EXPECT_NEAR(onecycle.Lr(123.0, 9), 0.05 / 25 / 1e4, 1e-15);  // the rate of the last step
  EXPECT_FALSE(onecycle.CyclesMomentum()) << "the momentum is the optimizer's by default";
  onecycle.set_steps(20);
  EXPECT_DOUBLE_EQ(onecycle.Lr(123.0, 5), 0.05);
  // --cycle_momentum: OneCycleLR's momentum, against the rate, over the
  // horizon as it moves.
  c.cycle_momentum = true;
  RunSchedule cycled(c, 10);
  EXPECT_TRUE(cycled.CyclesMomentum());
  EXPECT_DOUBLE_EQ(cycled.Lr(123.0, 2), 0.05);
  EXPECT_DOUBLE_EQ(cycled.Momentum(0), 0.95);
  EXPECT_DOUBLE_EQ(cycled.Momentum(2), 0.85);  // at the peak rate
  EXPECT_NEAR(cycled.Momentum(9), 0.95, 1e-12);
  EXPECT_EQ(cycled.MomentumBounds(), (std::vector<double>{0.85, 0.95}));
  cycled.set_steps(20);
  EXPECT_DOUBLE_EQ(cycled.Momentum(5), 0.85);
  c.cycle_momentum = false;
  for (const char* kind : {"plateau", "none", "linear"}) {
    c.scheduler = kind;
    EXPECT_THROW(RunSchedule(c, 10), std::invalid_argument) << kind;
  }
  EXPECT_FALSE(HasRunSchedule("plateau"));
  EXPECT_TRUE(HasRunSchedule("onecycle"));
}

// --scheduler=plateau: the plateau's state and the step it last took a
// metric at round-trip; the saved --lr is the base rate, not the reduced
// one (a resume would otherwise be refused for another --lr); another
// --lr_gamma or --lr_patience is refused naming both values, nothing
// loaded.
TEST(TrainStateTest, PlateauStateRoundTripsAndAnotherFactorOrPatienceIsRefused) {
  TrainConfig config;
  config.model = "mlp";
  config.scheduler = "plateau";
  config.lr_gamma = 0.5;
  config.lr_patience = 0;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  nn::optim::ReduceLrOnPlateau plateau(opt, PlateauOptionsOf(config));
  plateau.Step(1.0);
  plateau.Step(2.0);  // no better: halved at once (patience 0)
  ASSERT_EQ(opt.lr(), 0.025);
  TrainComponents parts{model.get(), &opt, nullptr, nullptr};
  parts.plateau = &plateau;
  const std::string path = Path("plateau");
  SaveTrainCheckpoint(path, parts, {.epoch = 2, .step = 8, .plateau_at_step = 8}, config, 2);

  nn::optim::Sgd back_opt(model->NamedParameters(), {.lr = config.lr});
  nn::optim::ReduceLrOnPlateau back(back_opt, PlateauOptionsOf(config));
  TrainComponents back_parts{model.get(), &back_opt, nullptr, nullptr};
  back_parts.plateau = &back;
  const TrainPosition pos = LoadTrainCheckpoint(path, back_parts, config, 2, nullptr);
  EXPECT_EQ(pos.plateau_at_step, 8);
  EXPECT_EQ(back_opt.lr(), 0.025);
  EXPECT_EQ(back.best(), 1.0);
  EXPECT_EQ(back.step_count(), 2);
  EXPECT_EQ(back.num_bad_steps(), plateau.num_bad_steps());

  const auto refused = [&](const TrainConfig& other) {
    nn::optim::Sgd o(model->NamedParameters(), {.lr = other.lr});
    nn::optim::ReduceLrOnPlateau p(o, PlateauOptionsOf(other));
    TrainComponents op{model.get(), &o, nullptr, nullptr};
    op.plateau = &p;
    const std::string error = UsageErrorOf([&] { LoadTrainCheckpoint(path, op, other, 2, nullptr); });
    EXPECT_EQ(p.step_count(), 0) << "a refused checkpoint was loaded";
    return error;
  };
  TrainConfig other = config;
  other.lr_gamma.reset();  // the default, 0.1
  EXPECT_EQ(refused(other),
            "checkpoint " + path + " was saved with --lr_gamma=0.5 and this run has "
            "--lr_gamma=0.1; pass --lr_gamma=0.5 to continue that run, or another --checkpoint "
            "path to start afresh");
  other = config;
  other.lr_patience = 3;
  EXPECT_EQ(refused(other),
            "checkpoint " + path + " was saved with --lr_patience=0 and this run has "
            "--lr_patience=3; pass --lr_patience=0 to continue that run, or another --checkpoint "
            "path to start afresh");
  other = config;
  other.scheduler = "cosine";
  other.lr_gamma.reset();
  other.lr_patience = 10;
  EXPECT_NE(UsageErrorOf([&] { LoadTrainCheckpoint(path, {model.get(), &back_opt, nullptr, nullptr},
                                                   other, 2, nullptr); })
                .find("was saved with --scheduler=plateau and this run has --scheduler=cosine"),
            std::string::npos);
}

// Milestones the run never reaches, and a plateau in a run that ends
// before its first epoch does, would do nothing: refused naming the flags.
TEST(TrainStateTest, ScheduleThatWouldDoNothingInTheRunIsRefused) {
  TrainConfig config;  // 2 epochs
  config.scheduler = "multistep";
  config.lr_milestones = {100, 938};
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 469); }),
            "--lr_milestones=100,938: step 938 would change nothing, this run ends at step 938 (2 "
            "epochs of 469 steps); pass milestones below 938");
  config.lr_milestones = {100, 937};
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 469); }), "");
  config = TrainConfig{};
  config.scheduler = "plateau";
  config.max_steps = 468;
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 469); }),
            "--scheduler=plateau takes the test loss at the end of each epoch, and this run ends "
            "at step 468 (--max_steps=468), before its first epoch of 469 steps ends; pass "
            "--max_steps=0 or at least 469, or another --scheduler");
  config.max_steps = 469;
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 469); }), "");
  // A factor above 1 that overflows the rate before the run ends: refused
  // before training, not an optimizer error some thousand steps in.
  config = TrainConfig{};
  config.scheduler = "exponential";
  config.lr_gamma = 1.5;
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 1000); }),
            "--lr_gamma=1.5 grows the rate past the largest number by the end of this run (step 2,000): "
            "--lr x --lr_gamma^2,000 overflows; pass a smaller --lr_gamma");
  config.lr_gamma = 1.001;  // 0.05 x 1.001^2000: about 0.37
  EXPECT_EQ(UsageErrorOf([&] { CheckScheduleFits(config, 1000); }), "");
}

// Schedules whose rate does not depend on the run's end resume with
// another --epochs (the ones that do are refused: RunLengthThatMovesTheScheduleIsRefused).
TEST(TrainStateTest, MultistepResumesWithMoreEpochs) {
  TrainConfig config;
  config.model = "mlp";
  config.scheduler = "multistep";
  config.lr_milestones = {3};
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  auto schedule = std::make_shared<RunSchedule>(config, RunEndStep(config, 4));
  nn::optim::LrScheduler scheduler(opt, schedule);
  for (int i = 0; i < 4; ++i) scheduler.Step();
  TrainComponents parts{model.get(), &opt, &scheduler, nullptr};
  parts.schedule = schedule.get();
  parts.batches_per_epoch = 4;
  const std::string path = Path("multistep");
  SaveTrainCheckpoint(path, parts, {.epoch = 1, .step = 4}, config, 2);
  TrainConfig longer = config;
  longer.epochs = 5;
  std::string note = "stale";
  EXPECT_EQ(LoadTrainCheckpoint(path, parts, longer, 2, &note).step, 4);
  EXPECT_EQ(note, "");
  EXPECT_DOUBLE_EQ(opt.lr(), config.lr * 0.1);
  TrainConfig other = config;
  other.lr_milestones = {2};
  EXPECT_EQ(UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, other, 2, nullptr); }),
            "checkpoint " + path + " was saved with --lr_milestones=3 and this run has "
            "--lr_milestones=2; pass --lr_milestones=3 to continue that run, or another "
            "--checkpoint path to start afresh");
}

// A checkpoint of a cosine RunSchedule from lr 0.05 (its horizon saved),
// saved at the end of the first of 2 epochs of 4 steps on 2 ranks.
std::string SaveRunScheduleRun(const std::string& name, TrainConfig& config) {
  config.model = "mlp";
  config.epochs = 2;
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = config.lr});
  auto schedule = std::make_shared<RunSchedule>(config, 8);
  nn::optim::LrScheduler scheduler(opt, schedule);
  for (int i = 0; i < 4; ++i) scheduler.Step();
  TrainComponents parts{model.get(), &opt, &scheduler, nullptr};
  parts.schedule = schedule.get();
  const std::string path = Path(name);
  SaveTrainCheckpoint(path, parts, {.epoch = 1, .batch_in_epoch = 0, .step = 4}, config, 2);
  return path;
}

// The UsageErrors ("" for none) of CheckTrainCheckpointHeader and of
// LoadTrainCheckpoint of `path` into `model`, with an SGD and this run's
// schedule made from `config`, at 4 micro-batches per epoch on 2 ranks.
std::pair<std::string, std::string> HeaderAndLoadErrors(const std::string& path, nn::modules::Module& model,
                                                        const TrainConfig& config) {
  nn::optim::Sgd opt(model.NamedParameters(), {.lr = config.lr});
  std::shared_ptr<RunSchedule> schedule;
  std::unique_ptr<nn::optim::LrScheduler> scheduler;
  if (HasRunSchedule(config.scheduler)) {
    schedule = std::make_shared<RunSchedule>(config, RunEndStep(config, 4));
    scheduler = std::make_unique<nn::optim::LrScheduler>(opt, schedule);
  }
  TrainComponents parts{&model, &opt, scheduler.get(), nullptr};
  parts.schedule = schedule.get();
  parts.batches_per_epoch = 4;
  const std::string header = UsageErrorOf([&] { CheckTrainCheckpointHeader(path, parts, config, 2); });
  return {header, UsageErrorOf([&] { LoadTrainCheckpoint(path, parts, config, 2, nullptr); })};
}

// The launcher's check of a --resume reads the checkpoint's header alone
// (it read and parsed the whole file, of any size, on its main thread):
// each refusal the header decides comes in the line the load gives, and no
// piece of the data is read.
TEST(TrainStateTest, HeaderCheckRefusesWhatTheHeaderDecidesInTheLoadsLine) {
  TrainConfig saved;
  const std::string path = SaveRunScheduleRun("header_check", saved);
  int64_t pieces = 0;
  nn::io::internal::SetReadPieceHookForTesting([&](uint64_t) { ++pieces; });
  auto mlp = nn::modules::MakeMlp();
  auto header_of = [&](const TrainConfig& config, nn::modules::Module& model) {
    pieces = 0;
    nn::optim::Sgd opt(model.NamedParameters(), {.lr = config.lr});
    auto schedule = std::make_shared<RunSchedule>(config, RunEndStep(config, 4));
    TrainComponents parts{&model, &opt};
    parts.schedule = schedule.get();
    parts.batches_per_epoch = 4;
    const std::string msg = UsageErrorOf([&] { CheckTrainCheckpointHeader(path, parts, config, 2); });
    EXPECT_EQ(pieces, 0) << "the header check read data";
    return msg;
  };
  EXPECT_EQ(header_of(saved, *mlp), "");
  nn::io::internal::SetReadPieceHookForTesting({});

  std::vector<std::pair<std::string, TrainConfig>> cases;
  const auto with = [&](const std::string& what, const std::function<void(TrainConfig&)>& change) {
    TrainConfig c = saved;
    change(c);
    cases.emplace_back(what, c);
  };
  with("--lr", [](TrainConfig& c) { c.lr = 0.1; });
  with("--scheduler", [](TrainConfig& c) { c.scheduler = "step"; });
  with("--optimizer", [](TrainConfig& c) { c.optimizer = "adamw"; });
  with("--amp", [](TrainConfig& c) { c.amp = "bf16"; });
  with("--dataset", [](TrainConfig& c) { c.dataset = "synthetic"; });
  with("--epochs", [](TrainConfig& c) { c.epochs = 3; });
  for (const auto& [what, config] : cases) {
    const auto [header, load] = HeaderAndLoadErrors(path, *mlp, config);
    EXPECT_NE(header.find(what + "="), std::string::npos) << header;
    EXPECT_EQ(header, load) << what;
  }
  TrainConfig cnn_config = saved;
  cnn_config.model = "cnn";
  auto cnn = nn::modules::MakeCnn();
  const auto [cnn_header, cnn_load] = HeaderAndLoadErrors(path, *cnn, cnn_config);
  EXPECT_NE(cnn_header.find("does not match --model=cnn: missing keys"), std::string::npos) << cnn_header;
  EXPECT_EQ(cnn_header, cnn_load);

  // Metadata out of range, or missing.
  const nn::io::Checkpoint whole = nn::io::LoadCheckpoint(path);
  for (const auto& [key, value] : {std::pair<std::string, std::string>{"epoch", "-1"}, {"epoch", ""}}) {
    nn::io::Checkpoint edited = whole;
    if (value.empty()) {
      edited.metadata.erase(key);
    } else {
      edited.metadata[key] = value;
    }
    const std::string other = Path("header_check_edited");
    nn::io::SaveCheckpoint(other, edited);
    const auto [header, load] = HeaderAndLoadErrors(other, *mlp, saved);
    EXPECT_NE(header.find(key), std::string::npos) << header;
    EXPECT_EQ(header, load);
  }
}

// What only the data tells is left to the load: a data region that does
// not match its checksum, and a scheduler step other than the position's.
// A file that is not a checkpoint, or not there, is refused by both.
TEST(TrainStateTest, HeaderCheckLeavesTheDataToTheLoad) {
  TrainConfig saved;
  const std::string path = SaveRunScheduleRun("header_check_data", saved);
  auto mlp = nn::modules::MakeMlp();
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 1));
  }
  auto [header, load] = HeaderAndLoadErrors(path, *mlp, saved);
  EXPECT_EQ(header, "");
  EXPECT_NE(load.find("--resume: " + path + ": "), std::string::npos) << load;

  nn::io::Checkpoint ckpt = nn::io::LoadCheckpoint(SaveRunScheduleRun("header_check_data", saved));
  for (auto& [name, t] : ckpt.optimizer) {
    if (name == "scheduler.step") t = nn::Full(t.shape(), 3, {.dtype = nn::DType::kInt64});
  }
  nn::io::SaveCheckpoint(path, ckpt);
  std::tie(header, load) = HeaderAndLoadErrors(path, *mlp, saved);
  EXPECT_EQ(header, "");
  EXPECT_NE(load.find("scheduler.step=3, out of range"), std::string::npos) << load;

  const std::string tensors = Path("header_check_tensors");
  nn::io::SaveTensors(tensors, {{"fc.weight", nn::Zeros({2, 3})}});
  std::tie(header, load) = HeaderAndLoadErrors(tensors, *mlp, saved);
  EXPECT_EQ(header, "--resume: " + tensors + ": no ddp.checkpoint metadata, not a checkpoint; the file was "
            "not written by this trainer: pass another --checkpoint, or drop --resume to start afresh (the "
            "first save then keeps this file beside it, as <stem>.prev.safetensors)");
  EXPECT_NE(load.find("not a checkpoint"), std::string::npos) << load;

  std::tie(header, load) = HeaderAndLoadErrors(Path("header_check_absent"), *mlp, saved);
  EXPECT_NE(header.find("no checkpoint at"), std::string::npos) << header;
  EXPECT_EQ(header, load);
}

// A checkpoint whose model the load converts to this run's dtype (--amp on
// the other kind of device) passes the header check as it loads.
TEST(TrainStateTest, HeaderCheckTakesTheModelInTheDTypeItLoadsIn) {
  TrainConfig cpu;
  cpu.model = "mlp";
  cpu.lr = 0.1;
  cpu.amp = "bf16";
  auto model = nn::modules::MakeMlp();
  model->To(nn::DType::kBFloat16);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("header_check_amp");
  SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {}, cpu, 1);
  TrainConfig gpu = cpu;
  gpu.device = "cuda";
  auto f32 = nn::modules::MakeMlp();
  nn::optim::Sgd f32_opt(f32->NamedParameters(), {.lr = 0.1});
  EXPECT_EQ(UsageErrorOf([&] {
              CheckTrainCheckpointHeader(path, {f32.get(), &f32_opt, nullptr, nullptr}, gpu, 1);
            }),
            "");
  // Without --device's conversion, the dtypes differ as the load says.
  TrainConfig older = gpu;
  nn::io::Checkpoint ckpt = nn::io::LoadCheckpoint(path);
  ckpt.metadata.erase("model_dtype");
  nn::io::SaveCheckpoint(path, ckpt);
  const std::string header = UsageErrorOf([&] {
    CheckTrainCheckpointHeader(path, {f32.get(), &f32_opt, nullptr, nullptr}, older, 1);
  });
  EXPECT_NE(header.find("different shapes or dtypes"), std::string::npos) << header;
  EXPECT_EQ(header, UsageErrorOf([&] {
              LoadTrainCheckpoint(path, {f32.get(), &f32_opt, nullptr, nullptr}, older, 1, nullptr);
            }));
}

// The run's identity goes with its checkpoints through its resumes (the
// trainer names the run whose rows --log_dir's metrics hold with it); a
// checkpoint saved before identities were has none.
TEST(TrainStateTest, RunIdentityIsSavedAndLoaded) {
  SavedMlpRun run("run_identity");
  EXPECT_EQ(LoadTrainCheckpoint(run.path, run.parts, run.config, 2, nullptr).run, "");
  const std::string id = NewRunId();
  EXPECT_EQ(id.size(), 16u) << id;
  EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  EXPECT_NE(NewRunId(), id);
  SaveTrainCheckpoint(run.path, run.parts, {.batch_in_epoch = 3, .run = id}, run.config, 2);
  EXPECT_EQ(LoadTrainCheckpoint(run.path, run.parts, run.config, 2, nullptr).run, id);
}

// What a failed save throws: a CheckpointSaveError (a failure of the run,
// the same exit status on every rank), "" when none.
std::string SaveErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointSaveError& e) {
    return e.what();
  }
  return "";
}

// A folder that cannot be made is the run's failure, not a UsageError
// (which rank 0 alone would exit with, as status 2, while the others
// exit 1), and the line names the checkpoint and the system's reason.
TEST(TrainStateTest, UnmakeableFolderIsASaveErrorNamingTheCheckpointAndTheReason) {
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = "/proc/no/such/dir/x.safetensors";
  const std::string msg = SaveErrorOf([&] {
    SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {}, TrainConfig{}, 1);
  });
  EXPECT_EQ(msg.rfind("cannot save the checkpoint " + path + ": " + std::strerror(ENOENT), 0), 0u) << msg;
  EXPECT_NE(msg.find("creating its folder /proc/no/such/dir"), std::string::npos) << msg;
}

// A write that fails part way (here: past the file size limit, EFBIG) names
// the checkpoint's path first, not the temporary file the write was in,
// with the system's reason.
TEST(TrainStateTest, FailedWriteNamesTheCheckpointPathAndTheSystemsReason) {
  auto model = nn::modules::MakeMlp();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const std::string path = Path("too_large");
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // its default ends the process
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = 4096;  // the MLP's parameters alone take far more
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  const std::string msg = SaveErrorOf([&] {
    SaveTrainCheckpoint(path, {model.get(), &opt, nullptr, nullptr}, {}, TrainConfig{}, 1);
  });
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(msg.rfind("cannot save the checkpoint " + path + ": " + std::strerror(EFBIG), 0), 0u) << msg;
  // The path and the reason once each (the writer's own message, added in
  // brackets, used to repeat both), then the failed call and the
  // temporary file.
  EXPECT_EQ(msg.find(std::strerror(EFBIG)), msg.rfind(std::strerror(EFBIG))) << msg;
  EXPECT_NE(msg.find(std::string(std::strerror(EFBIG)) + " (write failed, temporary file " + path + ".tmp."),
            std::string::npos)
      << msg;
  EXPECT_FALSE(std::filesystem::exists(path));
}

// The advice follows the reason: a full disk is not a matter of where one
// may write, and a read-only filesystem or a refused permission is not one
// of space.
TEST(TrainStateTest, SaveProblemAdviceFollowsTheReason) {
  const std::string full = CheckpointSaveProblem("c.safetensors", ENOSPC, "c.safetensors.tmp.1: write failed");
  EXPECT_EQ(full, std::string("cannot save the checkpoint c.safetensors: ") + std::strerror(ENOSPC) +
                      "; the disk is full: free some space on it, or pass --checkpoint=PATH on another "
                      "disk, or none");
  const std::string quota = CheckpointSaveProblem("c.safetensors", EDQUOT, "");
  EXPECT_NE(quota.find("quota"), std::string::npos) << quota;
  for (const int err : {EACCES, EPERM}) {
    const std::string refused = CheckpointSaveProblem("c.safetensors", err, "x");
    EXPECT_EQ(refused, std::string("cannot save the checkpoint c.safetensors: ") + std::strerror(err) +
                           "; pass --checkpoint=PATH in a folder this user may write to, or none");
  }
  const std::string read_only = CheckpointSaveProblem("c.safetensors", EROFS, "x");
  EXPECT_NE(read_only.find("writable filesystem"), std::string::npos) << read_only;
  EXPECT_EQ(read_only.find("full"), std::string::npos) << read_only;
  const std::string other = CheckpointSaveProblem("c.safetensors", EIO, "c.safetensors.tmp.1: fsync failed");
  EXPECT_EQ(other, std::string("cannot save the checkpoint c.safetensors: ") + std::strerror(EIO) +
                       " (c.safetensors.tmp.1: fsync failed); pass --checkpoint=PATH on a working, "
                       "writable disk, or none");
  // The writer's message leads with the path and holds the reason: neither
  // is said twice.
  const std::string writer = CheckpointSaveProblem(
      "c.safetensors", EIO,
      std::string("c.safetensors: fsync failed: ") + std::strerror(EIO) + " (temporary file c.safetensors.tmp.1)");
  EXPECT_EQ(writer, std::string("cannot save the checkpoint c.safetensors: ") + std::strerror(EIO) +
                        " (fsync failed, temporary file c.safetensors.tmp.1); pass --checkpoint=PATH on a "
                        "working, writable disk, or none");
}

}  // namespace
}  // namespace ddp::examples::trainer
