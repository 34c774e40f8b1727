// The trainer's checkpoint save on 2 ranks (worker processes of this test,
// RunTestWorkers): a write that outlasts the collectives' deadline
// (--timeout_s) keeps the other rank waiting, as long as
// --save_timeout_s allows. The write is made slow on purpose
// (nn::io::internal::SetWritePausePerPiece: each write of a piece of up to
// 64 MiB waits first), not left to the disk, as in ddp/checkpoint_test.cc.

#include <dlfcn.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "examples/trainer/config.h"
#include "examples/trainer/metrics_log.h"
#include "examples/trainer/parallel.h"
#include "examples/trainer/train_state.h"
#include "examples/trainer/trainer.h"
#include "gtest/gtest.h"
#include "nn/io/atomic_file.h"
#include "nn/io/safetensors.h"
#include "transport/launch/test_spawn.h"

// In a process given FAIL_FOLDER_FSYNC (a worker of this test), every
// fsync of a folder fails with EIO, as on a failing disk; files, and every
// other process, fsync as usual.
static int FsyncAsAsked(int fd) {
  static const bool fail_folders = std::getenv("FAIL_FOLDER_FSYNC") != nullptr;
  struct stat st{};
  if (fail_folders && ::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    errno = EIO;
    return -1;
  }
  using Fsync = int (*)(int);
  static const Fsync real = reinterpret_cast<Fsync>(::dlsym(RTLD_NEXT, "fsync"));
  return real(fd);
}

// The fsync of the whole test program, nn/io's writer included (this
// definition takes the place of the C library's): FsyncAsAsked, except in
// a process given FAIL_FILE_FSYNC, where the fsync of a regular file (a
// checkpoint's write, before its rename) throws std::bad_alloc, a failure
// that is not the disk's (called from C++ code only, which unwinds it).
extern "C" int fsync(int fd) {
  static const bool fail_files = std::getenv("FAIL_FILE_FSYNC") != nullptr;
  struct stat st{};
  if (fail_files && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) throw std::bad_alloc();
  return FsyncAsAsked(fd);
}

// In a process given NO_HARD_LINKS, linkat fails with EPERM, as on a
// filesystem without hard links (or with protected_hardlinks).
extern "C" int linkat(int olddirfd, const char* oldpath, int newdirfd, const char* newpath, int flags) noexcept {
  if (std::getenv("NO_HARD_LINKS") != nullptr) {
    errno = EPERM;
    return -1;
  }
  using Linkat = int (*)(int, const char*, int, const char*, int);
  static const Linkat real = reinterpret_cast<Linkat>(::dlsym(RTLD_NEXT, "linkat"));
  return real(olddirfd, oldpath, newdirfd, newpath, flags);
}

// In a process given LSTAT_EIO_PATH, lstat of that path fails with EIO,
// as on a failing disk; every other path, and every other process, as
// usual.
// In a process given LSTAT_HANG_PATH, lstat of that path waits 60 s
// first, as on a disk that hangs.
extern "C" int lstat(const char* path, struct stat* st) noexcept {
  static const char* failing = std::getenv("LSTAT_EIO_PATH");
  if (failing != nullptr && std::strcmp(path, failing) == 0) {
    errno = EIO;
    return -1;
  }
  static const char* hanging = std::getenv("LSTAT_HANG_PATH");
  if (hanging != nullptr && std::strcmp(path, hanging) == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  using Lstat = int (*)(const char*, struct stat*);
  static const Lstat real = reinterpret_cast<Lstat>(::dlsym(RTLD_NEXT, "lstat"));
  return real(path, st);
}

// Set on a thread, its next pthread_create fails with EAGAIN, as when
// RLIMIT_NPROC leaves no thread to start (the test runs as root, whom that
// limit does not bind); every other thread starts threads as usual.
static thread_local bool fail_next_thread_start = false;

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*),
                              void* arg) noexcept {
  if (fail_next_thread_start) {
    fail_next_thread_start = false;
    return EAGAIN;
  }
  using Create = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const Create real = reinterpret_cast<Create>(::dlsym(RTLD_NEXT, "pthread_create"));
  return real(thread, attr, start, arg);
}

namespace ddp::examples::trainer {
namespace {

namespace launch = transport::launch;

// One epoch of the MLP on 64 generated samples, 16 per batch, saving to
// `checkpoint`.
TrainConfig TinyRun(const char* checkpoint, int64_t timeout_s) {
  TrainConfig c;
  c.model = "mlp";
  c.dataset = "synthetic";
  c.train_samples = 64;
  c.test_samples = 32;
  c.batch_size = 16;
  c.epochs = 1;
  c.workers = 0;
  c.timeout_s = timeout_s;
  c.checkpoint = checkpoint;
  return c;
}

// Trains `c` as this worker's rank: exit status 0, or 1 after printing the
// error.
int TrainAsWorker(const TrainConfig& c, const RunOptions& options) {
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    Train(c, *parallel, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

// One epoch of the MLP on 64 generated samples (2 steps on 2 ranks), every
// collective bounded by 2 s, and a checkpoint at the epoch's end (at
// SLOW_SAVE_CKPT) each of whose writes (the length, the header, each
// tensor: at least 3) waits SLOW_SAVE_PAUSE_MS first. Exit status 0, or 1
// after printing the error.
DDP_TEST_WORKER(slow_save) {
  nn::io::internal::SetWritePausePerPiece(
      std::chrono::milliseconds(std::atoll(std::getenv("SLOW_SAVE_PAUSE_MS"))));
  TrainConfig c = TinyRun(std::getenv("SLOW_SAVE_CKPT"), 2);
  c.save_timeout_s = std::atoll(std::getenv("SLOW_SAVE_TIMEOUT_S"));
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// slow_save's run resumed from its checkpoint at SLOW_READ_CKPT (finished:
// the resumed run only evaluates), every collective bounded by 2 s; rank 0's read of the checkpoint waits SLOW_READ_PAUSE_MS
// first (internal::SetReadPause). Exit status 0, or 1 after printing the
// error.
DDP_TEST_WORKER(slow_resume) {
  const char* mark = std::getenv("SLOW_READ_STARTED_MARK");
  internal::SetReadPause(std::chrono::milliseconds(std::atoll(std::getenv("SLOW_READ_PAUSE_MS"))),
                         mark != nullptr ? mark : "");
  // A rank that dies while rank 0 reads: once rank 0's read has begun (the
  // pause's mark is there), it exits (status 3) without a word to the
  // others; status 4 if the read had not begun within 60 s.
  if (std::getenv("SLOW_READ_EXIT_ONCE_READING") != nullptr && mark != nullptr) {
    std::thread([path = std::string(mark)] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!std::filesystem::exists(path)) {
        if (std::chrono::steady_clock::now() > deadline) std::_Exit(4);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::_Exit(3);
    }).detach();
  }
  TrainConfig c = TinyRun(std::getenv("SLOW_READ_CKPT"), 2);
  c.resume = true;
  c.save_timeout_s = std::atoll(std::getenv("SLOW_READ_TIMEOUT_S"));
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// One epoch of the MLP on 64 generated samples (2 steps on 2 ranks) as job
// FRESH_RUN_JOB, without --resume, saving to FRESH_RUN_CKPT at its end;
// rank 0 prints its lines. Exit status 0, or 1 after printing the error.
DDP_TEST_WORKER(fresh_run) {
  TrainConfig c = TinyRun(std::getenv("FRESH_RUN_CKPT"), 30);
  c.job = std::getenv("FRESH_RUN_JOB");
  RunOptions options;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// fresh_run, with each write of its save waiting FRESH_RUN_PAUSE_MS first
// and --save_timeout_s=1.
DDP_TEST_WORKER(fresh_slow_save) {
  nn::io::internal::SetWritePausePerPiece(
      std::chrono::milliseconds(std::atoll(std::getenv("FRESH_RUN_PAUSE_MS"))));
  TrainConfig c = TinyRun(std::getenv("FRESH_RUN_CKPT"), 30);
  c.job = std::getenv("FRESH_RUN_JOB");
  c.save_timeout_s = 1;
  RunOptions options;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// fresh_run as job STUCK_JOB saving to STUCK_CKPT, whose write is stuck:
// each of its pieces waits STUCK_PAUSE_MS before it looks at its stop flag,
// as a write hung in the filesystem would (for longer than the test waits).
// --save_timeout_s=1 and --save_stop_grace_s=1.
DDP_TEST_WORKER(stuck_save) {
  nn::io::internal::SetWritePausePerPiece(
      std::chrono::milliseconds(std::atoll(std::getenv("STUCK_PAUSE_MS"))));
  TrainConfig c = TinyRun(std::getenv("STUCK_CKPT"), 30);
  c.job = std::getenv("STUCK_JOB");
  c.save_timeout_s = 1;
  c.save_stop_grace_s = 1;
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// One epoch of the MLP on 64 generated samples (2 steps on 2 ranks), every
// collective bounded by 20 s, saving to MIXED_CKPT: a path, or "" for
// --checkpoint=none. Exit status 0, or 1 after printing the error.
DDP_TEST_WORKER(mixed_checkpoint) {
  TrainConfig c = TinyRun(std::getenv("MIXED_CKPT"), 20);
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  return TrainAsWorker(c, options);
}

// mixed_checkpoint's run saving to FULL_SAVE_CKPT, with rank 0's files
// limited to FULL_SAVE_FSIZE bytes (when set) once it has joined the job
// (UCX's shared memory segments are files too): its save fails part way
// (EFBIG), as on a full disk. Exit status as //examples:train's: 2 for a
// UsageError (a mistake in the flags), 1 for any other failure.
DDP_TEST_WORKER(full_save) {
  const TrainConfig c = TinyRun(std::getenv("FULL_SAVE_CKPT"), 20);
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    if (const char* fsize = std::getenv("FULL_SAVE_FSIZE"); fsize != nullptr) {
      std::signal(SIGXFSZ, SIG_IGN);  // its default ends the process
      rlimit limit{};
      if (::getrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
      limit.rlim_cur = static_cast<rlim_t>(std::atoll(fsize));
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    }
    Train(c, *parallel, options);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "usage error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// A job whose sharded optimizer (--zero) on rank LOAD_FAULT_RANK throws
// std::bad_alloc when it loads a resumed run's state, as a rank out of
// memory would, and whose TraceFolder on rank `trace_fault_rank` (-1: none)
// throws it when the rank checks its own folders at the start; everything
// else is the real job's.
class LoadFaultParallel : public Parallel {
 public:
  LoadFaultParallel(std::unique_ptr<Parallel> job, int fault_rank, int trace_fault_rank = -1,
                    int lost_share_rank = -1, int lost_save_rank = -1)
      : job_(std::move(job)),
        fault_rank_(fault_rank),
        trace_fault_rank_(trace_fault_rank),
        lost_share_rank_(lost_share_rank),
        lost_save_rank_(lost_save_rank) {}

  int rank() const override { return job_->rank(); }
  int world_size() const override { return job_->world_size(); }
  void Prepare(std::shared_ptr<nn::modules::Module>& model, const TrainConfig& config) override {
    job_->Prepare(model, config);
  }
  void Attach(std::shared_ptr<nn::modules::Module> model, const TrainConfig& config, int64_t step,
              const std::vector<int64_t>& bucket_order) override {
    job_->Attach(std::move(model), config, step, bucket_order);
  }
  std::vector<int64_t> BucketOrder() const override { return job_->BucketOrder(); }
  dist::PowerSgdState* PowerSgd() const override { return job_->PowerSgd(); }
  nn::Tensor Forward(const nn::Tensor& input) override { return job_->Forward(input); }
  void Backward(const nn::Tensor& loss) override { job_->Backward(loss); }
  std::unique_ptr<NoSyncScope> NoSync() override { return job_->NoSync(); }
  void BroadcastBuffers() override { job_->BroadcastBuffers(); }
  std::unique_ptr<ShardedOptimizer> Shard(std::vector<nn::optim::ParamGroup> groups, const OptimizerFactory& make,
                                          bool overlap) override {
    return std::make_unique<FaultyLoad>(job_->Shard(std::move(groups), make, overlap), rank() == fault_rank_);
  }
  void SumAcrossRanks(std::vector<double>& values) override { job_->SumAcrossRanks(values); }
  std::string ShareFromLead(std::string value) override {
    if (rank() == lost_share_rank_) throw JobError("sharing rank 0's data: a peer was lost (the test's)");
    return job_->ShareFromLead(std::move(value));
  }
  std::vector<std::string> GatherFromEveryRank(const std::string& value) override {
    if (rank() == lost_share_rank_) throw JobError("gathering every rank's data: a peer was lost (the test's)");
    return job_->GatherFromEveryRank(value);
  }
  std::string RunOnLead(const std::function<void(const std::atomic<bool>& stop)>& work,
                        std::chrono::milliseconds timeout, const std::string& late,
                        std::chrono::milliseconds stop_grace, bool discardable) override {
    std::string outcome = job_->RunOnLead(work, timeout, late, stop_grace, discardable);
    // The work has ended; telling its outcome fails, as when a peer is lost.
    if (rank() == lost_save_rank_) throw JobError("waiting for rank 0: a peer was lost (the test's)");
    return outcome;
  }
  int VoteStop(int signal, bool slow) override { return job_->VoteStop(signal, slow); }
  int FinishStopVote() override { return job_->FinishStopVote(); }
  bool SlowSteps() const override { return job_->SlowSteps(); }
  std::string TakeStatsLine(bool every_rank) override { return job_->TakeStatsLine(every_rank); }
  bool CollectivesOnCaller() const override { return job_->CollectivesOnCaller(); }
  CommTotals Totals() override { return job_->Totals(); }
  std::string TraceFolder() const override {
    if (rank() == trace_fault_rank_) throw std::bad_alloc();
    return job_->TraceFolder();
  }

 private:
  class FaultyLoad : public ShardedOptimizer {
   public:
    FaultyLoad(std::unique_ptr<ShardedOptimizer> real, bool fails) : real_(std::move(real)), fails_(fails) {}
    double lr() const override { return real_->lr(); }
    void set_lr(double lr) override { real_->set_lr(lr); }
    void Step() override { real_->Step(); }
    void ZeroGrad() override { real_->ZeroGrad(); }
    nn::optim::NamedTensors Consolidate() override { return real_->Consolidate(); }
    void Load(const nn::optim::NamedTensors& whole) override {
      if (fails_) throw std::bad_alloc();
      real_->Load(whole);
    }

   private:
    std::unique_ptr<ShardedOptimizer> real_;
    bool fails_;
  };

  std::unique_ptr<Parallel> job_;
  int fault_rank_;
  int trace_fault_rank_;
  int lost_share_rank_;
  int lost_save_rank_;
};

// Trains `c` quietly as this worker's rank over the joined job's Parallel,
// which `prepare` may replace or surround (a status other than 0 from it
// ends the worker with that status). Exit status as //examples:train's: 2
// for a UsageError, 1 for any other failure; the line printed says whether
// the error is rank 0's (FromLead).
int TrainLikeTheTrainer(const TrainConfig& c,
                        const std::function<int(std::unique_ptr<Parallel>&)>& prepare = nullptr) {
  RunOptions options;
  options.quiet = true;
  options.print_result = false;
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    if (prepare) {
      if (const int status = prepare(parallel); status != 0) return status;
    }
    Train(c, *parallel, options);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "usage error%s: %s\n", IsFromLead(e) ? " (rank 0's)" : "", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error%s: %s\n", IsFromLead(e) ? " (rank 0's)" : "", e.what());
    return 1;
  }
  return 0;
}

// mixed_checkpoint's run with --zero, saving to ZERO_CKPT; with
// ZERO_RESUME set, resumed from it over LoadFaultParallel (LOAD_FAULT_RANK).
// Exit status as //examples:train's: 2 for a UsageError, 1 for any other
// failure; the line printed says whether the error is rank 0's (FromLead).
DDP_TEST_WORKER(zero_resume) {
  TrainConfig c = TinyRun(std::getenv("ZERO_CKPT"), 20);
  c.zero = true;
  c.resume = std::getenv("ZERO_RESUME") != nullptr;
  return TrainLikeTheTrainer(c, [](std::unique_ptr<Parallel>& parallel) {
    if (const char* rank = std::getenv("LOAD_FAULT_RANK"); rank != nullptr) {
      parallel = std::make_unique<LoadFaultParallel>(std::move(parallel), std::atoi(rank));
    }
    return 0;
  });
}

// An exception whose what() is empty.
class Wordless : public std::exception {
 public:
  const char* what() const noexcept override { return ""; }
};

// mixed_checkpoint's run resumed from READ_FAULT_CKPT; with READ_FAULT set,
// each piece this process reads of a file throws std::bad_alloc, as a read
// out of memory would (Wordless when READ_FAULT is "wordless"). Exit status
// and lines as zero_resume's.
DDP_TEST_WORKER(read_fault) {
  if (const char* fault = std::getenv("READ_FAULT"); fault != nullptr) {
    if (std::string(fault) == "wordless") {
      nn::io::internal::SetReadPieceHookForTesting([](uint64_t) { throw Wordless(); });
    } else {
      nn::io::internal::SetReadPieceHookForTesting([](uint64_t) { throw std::bad_alloc(); });
    }
  }
  TrainConfig c = TinyRun(std::getenv("READ_FAULT_CKPT"), 20);
  c.resume = true;
  return TrainLikeTheTrainer(c);
}

// mixed_checkpoint's run without a checkpoint over LoadFaultParallel,
// whose TraceFolder throws std::bad_alloc on rank OWN_CHECK_FAULT_RANK;
// with OWN_CHECK_LOG_DIR, metrics go there, and a rank given
// OWN_CHECK_FSIZE may write files of that many bytes at most once it has
// joined the job (as full_save). Exit status and lines as zero_resume's.
DDP_TEST_WORKER(own_check_fault) {
  TrainConfig c = TinyRun("", 20);
  if (const char* dir = std::getenv("OWN_CHECK_LOG_DIR"); dir != nullptr) c.log_dir = dir;
  return TrainLikeTheTrainer(c, [](std::unique_ptr<Parallel>& parallel) {
    const char* rank = std::getenv("OWN_CHECK_FAULT_RANK");
    parallel = std::make_unique<LoadFaultParallel>(std::move(parallel), -1, rank != nullptr ? std::atoi(rank) : -1);
    if (const char* fsize = std::getenv("OWN_CHECK_FSIZE"); fsize != nullptr) {
      std::signal(SIGXFSZ, SIG_IGN);  // its default ends the process
      rlimit limit{};
      if (::getrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
      limit.rlim_cur = static_cast<rlim_t>(std::atoll(fsize));
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    }
    return 0;
  });
}

// A one-rank run saving to LOST_SHARE_CKPT (resumed from it with
// LOST_SHARE_RESUME set) over LoadFaultParallel, whose ShareFromLead and
// GatherFromEveryRank throw JobError as a collective does when a peer is
// lost. Exit status and lines as zero_resume's.
DDP_TEST_WORKER(lost_share) {
  TrainConfig c = TinyRun(std::getenv("LOST_SHARE_CKPT"), 20);
  c.resume = std::getenv("LOST_SHARE_RESUME") != nullptr;
  return TrainLikeTheTrainer(c, [](std::unique_ptr<Parallel>& parallel) {
    parallel = std::make_unique<LoadFaultParallel>(std::move(parallel), -1, -1, /*lost_share_rank=*/0);
    return 0;
  });
}

// A static whose destructor writes `path` (when set): the process
// destroyed its statics on the way out.
struct ExitWitness {
  std::string path;
  ~ExitWitness() {
    if (!path.empty()) std::ofstream(path) << "statics destroyed\n";
  }
};

// A fresh run on 2 ranks (collectives bounded by 2 s) saving to
// HUNG_LOOK_CKPT, where a file is: rank 0's read of its header, to tell
// whose it is, waits 60 s first (internal::SetReadPause), as on a disk
// that hangs. Exit status and lines as zero_resume's.
// With HUNG_LOOK_EXIT_MARK set, rank 0 writes that file if its statics are
// destroyed at exit (ExitWitness) while its look is still in the read.
DDP_TEST_WORKER(hung_look) {
  // Made before the run: exit() destroys it after anything the run set up.
  static ExitWitness witness;
  internal::SetReadPause(std::chrono::seconds(60));
  return TrainLikeTheTrainer(TinyRun(std::getenv("HUNG_LOOK_CKPT"), 2), [](std::unique_ptr<Parallel>& parallel) {
    const char* mark = std::getenv("HUNG_LOOK_EXIT_MARK");
    if (mark != nullptr && parallel->rank() == 0) witness.path = mark;
    return 0;
  });
}

// A fresh run on 2 ranks (collectives bounded by 4 s) saving to
// HUNG_METRICS_CKPT, with --log_dir=HUNG_METRICS_DIR, whose MetricsLog
// waits 60 s before it looks at its files
// (internal::SetMetricsReadPause), as on a disk that hangs. Exit status
// and lines as zero_resume's.
DDP_TEST_WORKER(hung_metrics) {
  internal::SetMetricsReadPause(std::chrono::seconds(60));
  TrainConfig c = TinyRun(std::getenv("HUNG_METRICS_CKPT"), 4);
  c.log_dir = std::getenv("HUNG_METRICS_DIR");
  return TrainLikeTheTrainer(c);
}

// A safetensors file that holds no tensor and no metadata of this
// trainer's: what another program (Python) may leave at a path. (Its
// header, "{}", is 2 bytes long: 8 bytes of length first.)
const std::string kForeignSafetensors = std::string("\x02\0\0\0\0\0\0\0{}", 10);

// Votes to stop (as after Ctrl-C) at every step boundary on every rank.
// On rank 0, at the first vote (after the start's look at the checkpoint
// path, which found nothing), a file another program wrote
// (kForeignSafetensors) appears at `checkpoint`; with `hang`, every later
// read of a header there waits 60 s first (internal::SetReadPause), as on a
// disk that hangs.
class StopWithAHungFileParallel : public LoadFaultParallel {
 public:
  StopWithAHungFileParallel(std::unique_ptr<Parallel> job, std::string checkpoint, bool hang)
      : LoadFaultParallel(std::move(job), -1), checkpoint_(std::move(checkpoint)), hang_(hang) {}

  int VoteStop(int /*signal*/, bool slow) override {
    if (rank() == 0 && !file_made_) {
      std::ofstream(checkpoint_, std::ios::binary) << kForeignSafetensors;
      if (hang_) internal::SetReadPause(std::chrono::seconds(60));
      // The stop's look at the file, on this thread next, cannot start its
      // thread.
      fail_next_thread_start = std::getenv("HUNG_STOP_NO_THREAD") != nullptr;
      file_made_ = true;
    }
    return LoadFaultParallel::VoteStop(SIGINT, slow);
  }

 private:
  const std::string checkpoint_;
  const bool hang_;
  bool file_made_ = false;
};

// A fresh run on 2 ranks (collectives bounded by 4 s, or HUNG_STOP_TIMEOUT_S, 8 steps) saving to
// HUNG_STOP_CKPT, stopped after its first step over
// StopWithAHungFileParallel (whose read hangs unless HUNG_STOP_NO_HANG is
// set), before any save. Not quiet: rank 0 prints the stop's line. Exit
// status and lines as zero_resume's.
DDP_TEST_WORKER(hung_stop) {
  const char* checkpoint = std::getenv("HUNG_STOP_CKPT");
  const char* timeout_s = std::getenv("HUNG_STOP_TIMEOUT_S");
  TrainConfig c = TinyRun(checkpoint, timeout_s != nullptr ? std::atoll(timeout_s) : 4);
  c.train_samples = 256;
  RunOptions options;
  options.print_result = false;
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel =
        std::make_unique<StopWithAHungFileParallel>(JoinJob("", std::chrono::seconds(c.timeout_s)), checkpoint,
                                                    std::getenv("HUNG_STOP_NO_HANG") == nullptr);
    Train(c, *parallel, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error%s: %s\n", IsFromLead(e) ? " (rank 0's)" : "", e.what());
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

// A fresh run on 2 ranks saving to ODD_SAVE_CKPT, where another program's
// file is: every checkpoint write fails (FAIL_FILE_FSYNC, given to rank 0)
// with a failure that is not the disk's. Exit status and lines as
// zero_resume's.
DDP_TEST_WORKER(odd_save) { return TrainLikeTheTrainer(TinyRun(std::getenv("ODD_SAVE_CKPT"), 20)); }

// A fresh run on 2 ranks (collectives bounded by 4 s) saving to
// LSTAT_HANG_CKPT, where another program's file is. Exit status and lines
// as zero_resume's.
DDP_TEST_WORKER(lstat_hang) { return TrainLikeTheTrainer(TinyRun(std::getenv("LSTAT_HANG_CKPT"), 4)); }

// A fresh run on 2 ranks saving to LSTAT_EIO_PATH, whose lstat fails with
// EIO. Exit status and lines as zero_resume's.
DDP_TEST_WORKER(lstat_fault) { return TrainLikeTheTrainer(TinyRun(std::getenv("LSTAT_EIO_PATH"), 20)); }

// A one-rank run saving to LOST_SAVE_CKPT with its files limited to
// 3,000,000 bytes (its save fails part way: EFBIG) over LoadFaultParallel,
// whose RunOnLead throws JobError, as when a peer is lost, once the save
// has ended. Exit status and lines as zero_resume's.
DDP_TEST_WORKER(lost_save) {
  return TrainLikeTheTrainer(TinyRun(std::getenv("LOST_SAVE_CKPT"), 20), [](std::unique_ptr<Parallel>& parallel) {
    parallel = std::make_unique<LoadFaultParallel>(std::move(parallel), -1, -1, -1, /*lost_save_rank=*/0);
    std::signal(SIGXFSZ, SIG_IGN);  // its default ends the process
    rlimit limit{};
    if (::getrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    limit.rlim_cur = 3000000;
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    return 0;
  });
}

// This process's address space in use (VmSize), in bytes; 0 if unknown.
uint64_t VirtualMemoryBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

// Limits this process's address space to what it uses now plus
// `headroom` bytes while alive, and sets the old limit back on every way
// out.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(uint64_t headroom) {
    const uint64_t in_use = VirtualMemoryBytes();
    if (in_use == 0 || ::getrlimit(RLIMIT_AS, &old_) != 0) return;
    rlimit limit = old_;
    limit.rlim_cur = in_use + headroom;
    set_ = ::setrlimit(RLIMIT_AS, &limit) == 0;
  }
  ~AddressSpaceLimit() {
    if (set_) ::setrlimit(RLIMIT_AS, &old_);
  }
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;
  bool set() const { return set_; }

 private:
  rlimit old_{};
  bool set_ = false;
};

// Restart 1 of a job whose checkpoint is RESTART_CKPT: every rank follows
// rank 0's look at it (FollowRankZeroOnRestart), as //examples:train's
// ranks do. A rank given RESTART_HEADROOM_MB looks with its address space
// limited to that many MiB more than it uses. Exit status as
// //examples:train's: 2 for a UsageError, 1 for any other failure (10 if
// the limit cannot be set); the line printed says whether the error is
// rank 0's (FromLead).
DDP_TEST_WORKER(restart_fault) {
  // RESTART_HUNG: every rank's collectives are bounded by 4 s, and rank 0's
  // read of the checkpoint's header waits 60 s first, as on a disk that
  // hangs.
  const bool hung = std::getenv("RESTART_HUNG") != nullptr;
  if (hung) internal::SetReadPause(std::chrono::seconds(60));
  TrainConfig c = TinyRun(std::getenv("RESTART_CKPT"), hung ? 4 : 20);
  c.job = JobFingerprint("restart-fault-token");
  try {
    ValidateConfig(c);
    std::unique_ptr<Parallel> parallel = JoinJob("", std::chrono::seconds(c.timeout_s));
    std::optional<AddressSpaceLimit> limit;
    if (const char* mb = std::getenv("RESTART_HEADROOM_MB"); mb != nullptr) {
      limit.emplace(static_cast<uint64_t>(std::atoll(mb)) << 20);
      if (!limit->set()) return 10;
    }
    const std::string note = FollowRankZeroOnRestart(c, 1, *parallel);
    limit.reset();
    std::printf("%s\nresume: %d\n", note.c_str(), c.resume ? 1 : 0);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "usage error%s: %s\n", IsFromLead(e) ? " (rank 0's)" : "", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error%s: %s\n", IsFromLead(e) ? " (rank 0's)" : "", e.what());
    return 1;
  }
  std::fflush(stdout);
  return 0;
}

launch::testing::TestRunResult RunSlowSave(const std::string& checkpoint, int pause_ms,
                                           int save_timeout_s) {
  auto run = launch::testing::RunTestWorkers(
      "slow_save", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    // Rank 0 ends later, once its stopped write ends:
                    // each rank's own outcome is the test's.
                    .stop_all_on_failure = false,
                    .env = {{"SLOW_SAVE_CKPT", checkpoint},
                            {"SLOW_SAVE_PAUSE_MS", std::to_string(pause_ms)},
                            {"SLOW_SAVE_TIMEOUT_S", std::to_string(save_timeout_s)}}});
  EXPECT_TRUE(run.ok()) << run.status();
  return run.ok() ? *run : launch::testing::TestRunResult{};
}

std::string TempDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::create_directories(dir);
  return dir;
}

// Saves a two-rank checkpoint under TempDir(name), then runs "read_fault"
// on it, rank 0's reads failing as READ_FAULT=`fault` says; `seconds` gets
// the second run's wall time.
void RunReadFault(const std::string& name, const std::string& fault,
                  transport::StatusOr<launch::testing::TestRunResult>* run, double* seconds) {
  const std::string checkpoint = TempDir(name) + "/ckpt.safetensors";
  auto saved = launch::testing::RunTestWorkers(
      "mixed_checkpoint",
      {.world_size = 2, .timeout = std::chrono::seconds(90), .env = {{"MIXED_CKPT", checkpoint}}});
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(saved->AllSucceeded()) << saved->Summary() << saved->Output(0) << saved->Output(1);
  const auto start = std::chrono::steady_clock::now();
  *run = launch::testing::RunTestWorkers(
      "read_fault", {.world_size = 2,
                     .timeout = std::chrono::seconds(90),
                     .stop_all_on_failure = false,
                     .env = {{"READ_FAULT_CKPT", checkpoint}},
                     .rank_env = {{0, {{"READ_FAULT", fault}}}}});
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The writes of a save of `checkpoint`, each paused: the length, the header
// and each tensor's pieces of up to nn::io::kStopCheckBytes.
int64_t WritesOfTheSave(const std::string& checkpoint) {
  const nn::io::SafetensorsFile file = nn::io::SafetensorsFile::Read(checkpoint);
  int64_t writes = 2;
  for (const nn::io::TensorEntry& t : file.tensors()) {
    writes += static_cast<int64_t>((t.nbytes + nn::io::kStopCheckBytes - 1) / nn::io::kStopCheckBytes);
  }
  return writes;
}

// A save of 3 s or more, longer than the collectives' 2 s: rank 1 waits for it
// (rank 0 tells it every half second that it is still writing) and the run
// ends well. It used to wait in a broadcast bounded by --timeout_s and fail
// the job at the first epoch's end. Each write waits 150 ms, and there are
// 30 of them (4.5 s; checked to be 3 s at least: a second a write made this
// case 30 s long).
TEST(TrainerSaveTest, SaveLongerThanTheCollectiveTimeoutKeepsTheOthersWaiting) {
  constexpr int kPauseMs = 150;
  const std::string checkpoint = TempDir("slow") + "/ckpt.safetensors";
  const launch::testing::TestRunResult run = RunSlowSave(checkpoint, kPauseMs, 60);
  EXPECT_TRUE(run.AllSucceeded()) << run.Summary() << run.Output(0) << run.Output(1);
  ASSERT_TRUE(std::filesystem::is_regular_file(checkpoint)) << "no checkpoint";
  const int64_t writes = WritesOfTheSave(checkpoint);
  EXPECT_GE(writes * kPauseMs, 3000) << "only " << writes << " writes of " << kPauseMs
                                     << " ms: the save may not outlast the collectives' 2 s";
}

// Past --save_timeout_s every rank fails with a line that names the file
// and the flag, and the stopped write leaves nothing at the path.
TEST(TrainerSaveTest, SaveLongerThanSaveTimeoutFailsEveryRankNamingTheFile) {
  const std::string checkpoint = TempDir("late") + "/ckpt.safetensors";
  const launch::testing::TestRunResult run = RunSlowSave(checkpoint, 1000, 1);
  const std::string message = "rank 0 was still writing " + checkpoint + " after 1 s (--save_timeout_s)";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run.ExitCode(rank), 1) << run.Summary();
    EXPECT_NE(run.Output(rank).find(message), std::string::npos) << run.Output(rank);
  }
  EXPECT_FALSE(std::filesystem::exists(checkpoint));
}

// slow_resume on 2 ranks; with `rank1_dies_while_reading` rank 1 dies once
// rank 0's read has begun.
launch::testing::TestRunResult RunSlowResume(const std::string& checkpoint, int pause_ms,
                                             int save_timeout_s, bool rank1_dies_while_reading = false) {
  std::map<int, std::vector<std::pair<std::string, std::string>>> rank_env;
  if (rank1_dies_while_reading) {
    rank_env[1] = {{"SLOW_READ_EXIT_ONCE_READING", "1"}};
  }
  auto run = launch::testing::RunTestWorkers(
      "slow_resume", {.world_size = 2,
                      .timeout = std::chrono::seconds(90),
                      .stop_all_on_failure = false,
                      .env = {{"SLOW_READ_CKPT", checkpoint},
                              {"SLOW_READ_PAUSE_MS", std::to_string(pause_ms)},
                              {"SLOW_READ_TIMEOUT_S", std::to_string(save_timeout_s)},
                              {"SLOW_READ_STARTED_MARK", checkpoint + ".reading"}},
                      .rank_env = rank_env});
  EXPECT_TRUE(run.ok()) << run.status();
  return run.ok() ? *run : launch::testing::TestRunResult{};
}

// A checkpoint that took longer than --timeout_s to save may take as long
// to read back. Rank 1 used to wait for rank 0's read in a broadcast bounded
// by --timeout_s (2 s here) and fail the resume; it waits as for a save,
// up to --save_timeout_s, and the resumed run ends well.
TEST(TrainerSaveTest, ResumeReadLongerThanTheCollectiveTimeoutKeepsTheOthersWaiting) {
  const std::string checkpoint = TempDir("slow_read") + "/ckpt.safetensors";
  const launch::testing::TestRunResult saved = RunSlowSave(checkpoint, 0, 60);
  ASSERT_TRUE(saved.AllSucceeded()) << saved.Summary() << saved.Output(0) << saved.Output(1);
  const launch::testing::TestRunResult run = RunSlowResume(checkpoint, 3000, 60);
  EXPECT_TRUE(run.AllSucceeded()) << run.Summary() << run.Output(0) << run.Output(1);
}

// Past --save_timeout_s the resume fails on every rank with a line that
// names the file and the flag.
TEST(TrainerSaveTest, ResumeReadLongerThanSaveTimeoutFailsEveryRankNamingTheFile) {
  const std::string checkpoint = TempDir("late_read") + "/ckpt.safetensors";
  const launch::testing::TestRunResult saved = RunSlowSave(checkpoint, 0, 60);
  ASSERT_TRUE(saved.AllSucceeded()) << saved.Summary() << saved.Output(0) << saved.Output(1);
  const launch::testing::TestRunResult run = RunSlowResume(checkpoint, 5000, 1);
  const std::string message = "rank 0 was still reading " + checkpoint + " after 1 s (--save_timeout_s";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run.ExitCode(rank), 1) << run.Summary();
    EXPECT_NE(run.Output(rank).find(message), std::string::npos) << run.Output(rank);
  }
}

// A rank that dies while rank 0 reads the checkpoint ends the resume at
// once: rank 0's read, whose bytes nobody can use any more, is stopped
// instead of going on for as long as the disk takes (40 s here) or
// --save_timeout_s allows (60 s), and rank 0 reports the lost rank.
TEST(TrainerSaveTest, ResumeReadStopsAtOnceWhenAnotherRankDies) {
  const std::string checkpoint = TempDir("read_then_die") + "/ckpt.safetensors";
  const launch::testing::TestRunResult saved = RunSlowSave(checkpoint, 0, 60);
  ASSERT_TRUE(saved.AllSucceeded()) << saved.Summary() << saved.Output(0) << saved.Output(1);
  const auto start = std::chrono::steady_clock::now();
  const launch::testing::TestRunResult run = RunSlowResume(checkpoint, 40000, 60, /*rank1_dies_while_reading=*/true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(run.ExitCode(1), 3) << run.Summary();
  EXPECT_EQ(run.ExitCode(0), 1) << run.Summary();
  // Rank 1 died during the read, and rank 0 stopped the read for it.
  EXPECT_NE(run.Output(0).find("was asked to stop at once"), std::string::npos) << run.Output(0);
  EXPECT_LT(seconds, 25) << run.Output(0);
}

// Seconds CheckSetup(c, 2) takes while a read of a checkpoint's data waits
// 20 s first (internal::SetReadPause, as a slow or hung disk would);
// `refusal` gets its UsageError ("" for none).
double SecondsOfTheSetupCheckWhileReadsArePaused(const TrainConfig& c, std::string* refusal) {
  internal::SetReadPause(std::chrono::seconds(20));
  const auto start = std::chrono::steady_clock::now();
  refusal->clear();
  try {
    CheckSetup(c, 2);
  } catch (const UsageError& e) {
    *refusal = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  internal::SetReadPause(std::chrono::milliseconds(0));
  return seconds;
}

// While alive, this process may open no more files than it holds now:
// every open fails with EMFILE, as in a process out of file handles. The
// old limit is set back on every way out.
class NoMoreFiles {
 public:
  NoMoreFiles() {
    const int lowest_free = ::dup(0);
    if (lowest_free < 0 || ::getrlimit(RLIMIT_NOFILE, &old_) != 0) return;
    ::close(lowest_free);
    rlimit limit = old_;
    limit.rlim_cur = static_cast<rlim_t>(lowest_free);
    set_ = ::setrlimit(RLIMIT_NOFILE, &limit) == 0;
  }
  ~NoMoreFiles() {
    if (set_) ::setrlimit(RLIMIT_NOFILE, &old_);
  }
  NoMoreFiles(const NoMoreFiles&) = delete;
  NoMoreFiles& operator=(const NoMoreFiles&) = delete;
  bool set() const { return set_; }

 private:
  rlimit old_{};
  bool set_ = false;
};

// CheckSetup(c, 1): "" when it passes, else "usage error: " and its
// UsageError's text or "error: " and another exception's; run out of file
// handles with `no_more_files`.
std::string SetupCheckOutcome(const TrainConfig& c, bool no_more_files) {
  std::optional<NoMoreFiles> limit;
  if (no_more_files) {
    limit.emplace();
    if (!limit->set()) return "the open-file limit could not be set";
  }
  try {
    CheckSetup(c, 1);
  } catch (const UsageError& e) {
    return std::string("usage error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
  return "";
}

// The write test of an output folder failing for the host's reasons (no
// file handle left, as here; a full disk, an I/O error) fails the run with
// the system's reason, rather than refusing the flag (exit status 2) with
// "not writable", which sent the user after a path that was fine. A
// folder the filesystem refuses is still refused, now with its reason.
TEST(TrainerSaveTest, AnOutputFolderTheHostCannotWriteFailsTheRunWithTheSystemsReason) {
  TrainConfig c = TinyRun("", 2);
  c.log_dir = TempDir("host_failure") + "/logs";
  EXPECT_EQ(SetupCheckOutcome(c, /*no_more_files=*/true),
            "error: cannot write --log_dir=" + c.log_dir + " (folder " + c.log_dir +
                ": no file could be created there: " + std::strerror(EMFILE) + ")");
  EXPECT_FALSE(std::filesystem::exists(c.log_dir)) << "the folder made for the check was left";
  c.log_dir.clear();
  c.checkpoint = "/proc/self/ckpt.safetensors";
  EXPECT_EQ(SetupCheckOutcome(c, /*no_more_files=*/false),
            "usage error: cannot write --checkpoint=/proc/self/ckpt.safetensors (folder /proc/self: not "
            "writable (" + std::string(std::strerror(ENOENT)) + ")); choose a writable path, or --checkpoint=none");
}

// The launcher's check of a --resume, before any rank starts, read and
// parsed the whole checkpoint on its main thread, with no deadline and no
// stop (Ctrl-C there only printed a line): a slow disk held it as long as
// the read took. It reads the header alone; rank 0 reads the data, under
// --save_timeout_s.
TEST(TrainerSaveTest, SetupCheckOfAResumeReadsNoDataAndRefusesFromTheHeader) {
  const std::string checkpoint = TempDir("setup_check") + "/ckpt.safetensors";
  const launch::testing::TestRunResult saved = RunSlowSave(checkpoint, 0, 60);
  ASSERT_TRUE(saved.AllSucceeded()) << saved.Summary() << saved.Output(0) << saved.Output(1);
  TrainConfig c = TinyRun(checkpoint.c_str(), 2);
  c.resume = true;
  std::string refusal;
  EXPECT_LT(SecondsOfTheSetupCheckWhileReadsArePaused(c, &refusal), 10) << "it waited for the paused read";
  EXPECT_EQ(refusal, "");
  // What the header decides is still refused before any rank starts,
  // naming the flag.
  c.lr = 0.1;
  EXPECT_LT(SecondsOfTheSetupCheckWhileReadsArePaused(c, &refusal), 10) << "it waited for the paused read";
  EXPECT_EQ(refusal, "checkpoint " + checkpoint + " was saved with --lr=0.05 and this run has --lr=0.1; pass "
                     "--lr=0.05 to continue that run, or another --checkpoint path to start afresh");
  c = TinyRun(checkpoint.c_str(), 2);
  c.resume = true;
  c.model = "cnn";
  EXPECT_LT(SecondsOfTheSetupCheckWhileReadsArePaused(c, &refusal), 10) << "it waited for the paused read";
  EXPECT_NE(refusal.find("checkpoint " + checkpoint + " does not match --model=cnn: missing keys"),
            std::string::npos)
      << refusal;
}

// Ranks of which some save checkpoints and some do not (--checkpoint=none
// on one rank's command line) used to part ways at the first save: rank 0
// entered the save's collective and the other the evaluation's, and the job
// failed there ("all-reduce arguments differ across ranks"), or waited
// until --timeout_s where the mismatch is not caught, with no word of
// --checkpoint. They are refused at the start, naming it, as other
// differing flags are.
TEST(TrainerSaveTest, RanksThatDisagreeOnCheckpointingAreRefusedNamingTheFlag) {
  const std::string checkpoint = TempDir("mixed") + "/ckpt.safetensors";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "mixed_checkpoint", {.world_size = 2,
                           .timeout = std::chrono::seconds(90),
                           .stop_all_on_failure = false,
                           .rank_env = {{0, {{"MIXED_CKPT", checkpoint}}}, {1, {{"MIXED_CKPT", ""}}}}});
  ASSERT_TRUE(run.ok()) << run.status();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(run->Output(1).find("started with --checkpoint=none but rank 0 with --checkpoint="),
            std::string::npos)
      << run->Output(1);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find("every rank needs the same flags and data"), std::string::npos)
        << run->Output(rank);
  }
  EXPECT_LT(seconds, 15) << "the ranks waited for the collectives' deadline";
  EXPECT_FALSE(std::filesystem::exists(checkpoint));
}

// A save that fails on rank 0's disk (a write past the file size limit,
// as on a full one) used to end rank 0 with a UsageError (status 2, "pass
// --checkpoint=PATH somewhere writable") naming the temporary file, and
// the other ranks with status 1. Every rank fails alike, naming the
// checkpoint and the system's reason.
TEST(TrainerSaveTest, SaveFailingOnRankZerosDiskFailsEveryRankAlikeNamingTheCheckpoint) {
  const std::string checkpoint = TempDir("full") + "/ckpt.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "full_save", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"FULL_SAVE_CKPT", checkpoint}},
                    // The MLP's 535,818 parameters and their momentum take 4 MiB.
                    .rank_env = {{0, {{"FULL_SAVE_FSIZE", "3000000"}}}}});
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string reason = "cannot save the checkpoint " + checkpoint + ": " + std::strerror(EFBIG);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find("error: rank 0 could not save the checkpoint: " + reason), std::string::npos)
        << run->Output(rank);
  }
  EXPECT_FALSE(std::filesystem::exists(checkpoint));
}

// A save whose file is whole, fsynced and renamed into place, and only the
// fsync of its folder failed (EIO on rank 0's disk): the run still fails
// on every rank, but the line says what is true, that the checkpoint is
// there and --resume continues from it, only its surviving a crash is in
// doubt. It used to say "could not save the checkpoint: cannot save the
// checkpoint ... (written and renamed into place ...)".
TEST(TrainerSaveTest, SaveInPlaceWhoseFolderFsyncFailedSaysTheCheckpointIsThere) {
  const std::string checkpoint = TempDir("folder_fsync") + "/ckpt.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "full_save", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"FULL_SAVE_CKPT", checkpoint}},
                    .rank_env = {{0, {{"FAIL_FOLDER_FSYNC", "1"}}}}});
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string line = "error: rank 0: the checkpoint " + checkpoint +
                           " is saved and in place (--resume continues from it), but the fsync of its "
                           "folder failed: " + std::strerror(EIO) +
                           ", so a crash of this host may still lose it; pass --checkpoint=PATH on a "
                           "working disk, or none\n";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find(line), std::string::npos) << run->Output(rank);
  }
  // It is there, whole: a resume reads it.
  EXPECT_NO_THROW(nn::io::SafetensorsFile::Read(checkpoint));
}

// A rank that runs out of memory while it loads its shard of a resumed
// run's optimizer state (--zero) fails the run (exit status 1) with its own
// reason, and rank 0, whose collective load then loses its peer, with its
// own. Both used to end as a refusal of the checkpoint (exit status 2,
// "has optimizer state this run cannot use"), as if the file were bad.
TEST(TrainerSaveTest, ResourceFailureInTheOptimizerLoadIsTheRanksOwnNotABadCheckpoint) {
  const std::string checkpoint = TempDir("zero_load") + "/ckpt.safetensors";
  auto saved = launch::testing::RunTestWorkers(
      "zero_resume", {.world_size = 2, .timeout = std::chrono::seconds(90), .env = {{"ZERO_CKPT", checkpoint}}});
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(saved->AllSucceeded()) << saved->Summary() << saved->Output(0) << saved->Output(1);
  auto run = launch::testing::RunTestWorkers(
      "zero_resume", {.world_size = 2,
                      .timeout = std::chrono::seconds(90),
                      .stop_all_on_failure = false,
                      .env = {{"ZERO_CKPT", checkpoint}, {"ZERO_RESUME", "1"}, {"LOAD_FAULT_RANK", "1"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_EQ(run->Output(rank).find("cannot use"), std::string::npos) << run->Output(rank);
    EXPECT_EQ(run->Output(rank).find("rank 0's"), std::string::npos) << run->Output(rank);
  }
  EXPECT_NE(run->Output(1).find("error: std::bad_alloc"), std::string::npos) << run->Output(1);
}

// Rank 0's read of the checkpoint failing for want of memory is a failure
// of the run on every rank (exit status 1, as on rank 0), the others
// pointing at rank 0's reason. They used to end as if rank 0 had refused
// the file (exit status 2, a mistake in the flags) while rank 0 ended
// with 1.
TEST(TrainerSaveTest, RankZerosReadFailingOtherwiseThanOnTheFileEndsEveryRankWithItsStatus) {
  transport::StatusOr<launch::testing::TestRunResult> run = transport::InternalError("not run");
  double seconds = 0;
  ASSERT_NO_FATAL_FAILURE(RunReadFault("read_fault", "1", &run, &seconds));
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("error: std::bad_alloc"), std::string::npos) << run->Output(0);
  EXPECT_NE(run->Output(1).find("error (rank 0's): std::bad_alloc"), std::string::npos) << run->Output(1);
}

// Rank 0's read failing with an exception that says nothing ends every
// rank at once with status 1, each line saying so: the wait for rank 0's
// part hands on a text for it, so the others do not take rank 0's failure
// for a read that worked and wait for its bytes. Rank 0's own line used to
// be "error: " with no reason at all.
TEST(TrainerSaveTest, RankZerosReadFailingWithoutAMessageStillEndsEveryRank) {
  transport::StatusOr<launch::testing::TestRunResult> run = transport::InternalError("not run");
  double seconds = 0;
  ASSERT_NO_FATAL_FAILURE(RunReadFault("read_fault_wordless", "wordless", &run, &seconds));
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("error: an exception without a message\n"), std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(1).find("error (rank 0's): an exception without a message\n"), std::string::npos)
      << run->Output(1);
  // Well under the collectives' 20 s deadline (TinyRun's --timeout_s).
  EXPECT_LT(seconds, 15) << run->Output(1);
}

// A rank whose own check at the start (its device, its trace folder) fails
// otherwise than by refusing its input (out of memory here) fails the run:
// it ends with exit status 1 and its own reason, and every other rank with
// status 1 too, naming it. Every rank used to end as if that rank had
// refused its flags (exit status 2, a mistake to fix).
TEST(TrainerSaveTest, ResourceFailureInARanksOwnCheckAtTheStartFailsTheRunNotItsFlags) {
  auto run = launch::testing::RunTestWorkers(
      "own_check_fault",
      {.world_size = 2, .timeout = std::chrono::seconds(90), .stop_all_on_failure = false,
       .env = {{"OWN_CHECK_FAULT_RANK", "1"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(1).find("error: std::bad_alloc\n"), std::string::npos) << run->Output(1);
  EXPECT_NE(run->Output(0).find("error: rank 1 cannot go on: std::bad_alloc\n"), std::string::npos)
      << run->Output(0);
}

// Rank 0's metrics log failing to be written at the start (a file size
// limit, as a full disk would) fails the run on every rank (exit status 1),
// rank 0 naming metrics.csv and the system's reason, the others pointing
// at rank 0's line. Every rank used to end as if rank 0 had refused its
// flags (exit status 2).
TEST(TrainerSaveTest, RankZerosOutputSetupFailingOnItsDiskFailsTheRunNotItsFlags) {
  const std::string dir = TempDir("log_fault");
  auto run = launch::testing::RunTestWorkers(
      "own_check_fault", {.world_size = 2,
                          .timeout = std::chrono::seconds(90),
                          .stop_all_on_failure = false,
                          .env = {{"OWN_CHECK_LOG_DIR", dir}},
                          .rank_env = {{0, {{"OWN_CHECK_FSIZE", "16"}}}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
  }
  const std::string reason = dir + "/metrics.csv: write failed: " + std::strerror(EFBIG);
  EXPECT_NE(run->Output(0).find("error: " + reason), std::string::npos) << run->Output(0);
  EXPECT_NE(run->Output(1).find("error (rank 0's): " + reason), std::string::npos) << run->Output(1);
}

// Rank 0 running out of memory while it reads the checkpoint's header at
// a restart (a sparse file whose header length is 90 MB, read with 32 MiB
// of address space to spare) fails the run on every rank at once: rank 0
// with its own reason, the other pointing at it, both with exit status 1.
// Only a refusal used to be shared: rank 0 ended before telling the
// others, who waited for it until they lost it or --timeout_s (20 s here)
// passed, and ended without its reason. A header that is damaged is still
// refused on every rank (exit status 2), naming the file.
TEST(TrainerSaveTest, RankZerosHeaderReadOutOfMemoryAtARestartEndsEveryRankWithItsReason) {
  const std::string checkpoint = TempDir("restart_fault") + "/ckpt.safetensors";
  constexpr uint64_t kHeaderBytes = 90'000'000;
  {
    std::ofstream out(checkpoint, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((kHeaderBytes >> (8 * i)) & 0xff));
  }
  std::filesystem::resize_file(checkpoint, 8 + kHeaderBytes);  // sparse
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "restart_fault", {.world_size = 2,
                        .timeout = std::chrono::seconds(90),
                        .stop_all_on_failure = false,
                        .env = {{"RESTART_CKPT", checkpoint}},
                        .rank_env = {{0, {{"RESTART_HEADROOM_MB", "32"}}}}});
  ASSERT_TRUE(run.ok()) << run.status();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("error: std::bad_alloc\n"), std::string::npos) << run->Output(0);
  EXPECT_NE(run->Output(1).find("error (rank 0's): std::bad_alloc\n"), std::string::npos) << run->Output(1);
  // Well under the collectives' 20 s deadline.
  EXPECT_LT(seconds, 15) << run->Output(1);

  // The same header cut short: the file's fault, refused on every rank.
  std::filesystem::resize_file(checkpoint, 100);
  run = launch::testing::RunTestWorkers(
      "restart_fault", {.world_size = 2,
                        .timeout = std::chrono::seconds(90),
                        .stop_all_on_failure = false,
                        .env = {{"RESTART_CKPT", checkpoint}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 2) << run->Summary() << run->Output(rank);
  }
  const std::string refusal = "cannot read the checkpoint at " + checkpoint;
  EXPECT_NE(run->Output(0).find("usage error: restart 1 of the job: " + refusal), std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(1).find("usage error (rank 0's): restart 1 of the job: " + refusal), std::string::npos)
      << run->Output(1);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Rank 0's look at the checkpoint at a restart (is it this job's?) had no
// deadline: a header read hung in the filesystem held rank 0 for good while
// the others failed at the collective's deadline without its reason. It
// ends within half of --timeout_s now, and every rank fails with rank 0's
// line naming the file, which is left as it is.
TEST(TrainerSaveTest, AHungLookAtTheCheckpointAtARestartEndsEveryRankNamingIt) {
  const std::string checkpoint = TempDir("restart_hung") + "/ckpt.safetensors";
  std::ofstream(checkpoint) << "a checkpoint on a disk that hangs";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "restart_fault", {.world_size = 2,
                        .timeout = std::chrono::seconds(90),
                        .stop_all_on_failure = false,
                        .env = {{"RESTART_CKPT", checkpoint}, {"RESTART_HUNG", "1"}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string reason = "restart 1 of the job: cannot read the header of the checkpoint at " + checkpoint +
                             " within 2.0s (half of --timeout_s), to tell whether it is this job's";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find(reason), std::string::npos) << run->Output(rank);
  }
  EXPECT_EQ(ReadFile(checkpoint), "a checkpoint on a disk that hangs");
  EXPECT_LT(seconds, 40) << "the 60 s read was waited out";
}

// Rank 0's look at --log_dir's metrics.csv and metrics.run (all of its
// rows, on a resume) had no deadline: a disk that hung held rank 0 while
// the others failed at their collective's deadline, without its reason.
// Within half of --timeout_s, every rank fails naming the files.
TEST(TrainerSaveTest, AHungLookAtTheMetricsEndsEveryRankNamingThem) {
  const std::string dir = TempDir("hung_metrics");
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "hung_metrics", {.world_size = 2,
                       .timeout = std::chrono::seconds(90),
                       .stop_all_on_failure = false,
                       .env = {{"HUNG_METRICS_CKPT", dir + "/ckpt.safetensors"},
                               {"HUNG_METRICS_DIR", dir + "/logs"}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string reason = "--log_dir=" + dir + "/logs: cannot look at " + dir + "/logs/metrics.csv and " + dir +
                             "/logs/metrics.run within 2.0s (half of --timeout_s)";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find(reason), std::string::npos) << run->Output(rank);
  }
  EXPECT_LT(seconds, 40) << "the 60 s look was waited out";
}

// Rank 0's own failure at the start (a resume's checkpoint that is not
// there; a --checkpoint folder it cannot write), when the collective that
// tells the others fails too (a peer lost): rank 0 ends with its own
// reason, of its own kind (a refusal: exit status 2), and says the others
// could not be told. Its line used to give the lost collective alone
// ("sharing rank 0's data: ..."), with exit status 1.
TEST(TrainerSaveTest, RankZerosOwnFailureIsReportedWhenTellingTheOthersFailsToo) {
  const std::string missing = TempDir("lost_share") + "/missing.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "lost_share", {.world_size = 1,
                     .timeout = std::chrono::seconds(90),
                     .env = {{"LOST_SHARE_CKPT", missing}, {"LOST_SHARE_RESUME", "1"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ExitCode(0), 2) << run->Summary() << run->Output(0);
  EXPECT_NE(run->Output(0).find("usage error: --resume: no checkpoint at " + missing), std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(0).find("(the other ranks could not be told: sharing rank 0's data: a peer was "
                                "lost (the test's))\n"),
            std::string::npos)
      << run->Output(0);

  run = launch::testing::RunTestWorkers(
      "lost_share", {.world_size = 1,
                     .timeout = std::chrono::seconds(90),
                     .env = {{"LOST_SHARE_CKPT", "/proc/self/ckpt.safetensors"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ExitCode(0), 2) << run->Summary() << run->Output(0);
  EXPECT_NE(run->Output(0).find("usage error: cannot write --checkpoint=/proc/self/ckpt.safetensors (folder "
                                "/proc/self: "),
            std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(0).find("(the other ranks could not be told: sharing rank 0's data: a peer was "
                                "lost (the test's))\n"),
            std::string::npos)
      << run->Output(0);
}

// Rank 0's look at the file already at --checkpoint (whose run's it is)
// had no deadline: a read hung in the filesystem held rank 0 while the
// others failed at the collective's deadline without its reason. It ends
// within half of --timeout_s now, and every rank fails with rank 0's line.
TEST(TrainerSaveTest, AHungLookAtTheFileAtTheCheckpointPathEndsEveryRankNamingIt) {
  const std::string checkpoint = TempDir("hung_look") + "/ckpt.safetensors";
  std::ofstream(checkpoint) << "a file another program wrote";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "hung_look", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_LOOK_CKPT", checkpoint}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string reason = "cannot read the header of --checkpoint=" + checkpoint + " within ";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find(reason), std::string::npos) << run->Output(rank);
  }
  EXPECT_LT(seconds, 40) << "the 60 s read was waited out";
}

// The same hung look: rank 0 fails and exits while its look is still in
// the 60 s read. exit() destroyed the program's statics under it (a read
// that returned then ran on in torn-down state: undefined behaviour that
// could crash over the exit status); the process now ends at once, with
// its status and its line, and destroys nothing.
TEST(TrainerSaveTest, ARankThatLeftALookRunningEndsWithoutDestroyingItsStatics) {
  const std::string dir = TempDir("hung_look_exit");
  const std::string checkpoint = dir + "/ckpt.safetensors";
  const std::string mark = dir + "/statics_destroyed";
  std::ofstream(checkpoint) << "a file another program wrote";
  auto run = launch::testing::RunTestWorkers(
      "hung_look", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_LOOK_CKPT", checkpoint}, {"HUNG_LOOK_EXIT_MARK", mark}}});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ExitCode(0), 1) << run->Summary() << run->Output(0);
  EXPECT_NE(run->Output(0).find("cannot read the header of --checkpoint=" + checkpoint + " within "),
            std::string::npos)
      << run->Output(0);
  EXPECT_FALSE(std::filesystem::exists(mark)) << "rank 0 destroyed its statics while its look still ran";
}

// A fresh run stopped before its first save (Ctrl-C) looks at the file at
// --checkpoint again, to keep another run's: that look had no deadline, and
// a read hung in the filesystem held rank 0 there for good while the others
// failed at their deadline. It ends within half of --timeout_s now: the
// file, which may be a good checkpoint, is left as it is, every rank stops
// as asked, and rank 0's line says why nothing was saved.
TEST(TrainerSaveTest, AHungLookAtTheCheckpointPathWhenStoppedLeavesTheFileAndEndsInTime) {
  const std::string checkpoint = TempDir("hung_stop") + "/ckpt.safetensors";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "hung_stop", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_STOP_CKPT", checkpoint}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 0) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("stopped by Ctrl-C at epoch 1, step 1; cannot read the header of --checkpoint=" +
                                checkpoint + " within 2.0s (half of --timeout_s), to tell whose file it is (its "
                                "disk may hang), so it was left as it was (this run had saved nothing yet)"),
            std::string::npos)
      << run->Output(0);
  EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was replaced";
  EXPECT_LT(seconds, 40) << "the 60 s read was waited out";
}

// The same stop with a --timeout_s of 60 s: the look at the file waited
// half of it, 30 s (150 s at the default 300), longer than a launcher's
// grace between SIGTERM and SIGKILL (ddprun's 30 s), which killed the stop
// before its line. At a stop it waits at most 10 s.
TEST(TrainerSaveTest, AHungLookWhenStoppedEndsWithinALaunchersGrace) {
  const std::string checkpoint = TempDir("hung_stop_long") + "/ckpt.safetensors";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "hung_stop", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_STOP_CKPT", checkpoint}, {"HUNG_STOP_TIMEOUT_S", "60"}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 0) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("cannot read the header of --checkpoint=" + checkpoint +
                                " within 10.0s (the most a stop waits, to end within a launcher's grace)"),
            std::string::npos)
      << run->Output(0);
  EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was replaced";
  EXPECT_LT(seconds, 25) << "the look outlasted a launcher's 30 s grace";
}

// The same stop, where the file at --checkpoint reads (a file this trainer
// did not write: weights exported from Python, say): it is left as it is,
// and the stop's line says what it is. It called any such file "the
// checkpoint at P, another run's".
TEST(TrainerSaveTest, AStopBeforeTheFirstSaveSaysWhatTheFileItLeftIs) {
  const std::string checkpoint = TempDir("foreign_stop") + "/ckpt.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "hung_stop", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_STOP_CKPT", checkpoint}, {"HUNG_STOP_NO_HANG", "1"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 0) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("stopped by Ctrl-C at epoch 1, step 1; the file at " + checkpoint +
                                ", a file this trainer did not write, was left as it was (this run had saved "
                                "nothing yet)"),
            std::string::npos)
      << run->Output(0);
  EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was replaced";
}

// The same stop, where rank 0's look at the file cannot start its thread
// (RLIMIT_NPROC, here a pthread_create made to fail): the look's
// std::system_error ended rank 0's stop before it shared its decision, and
// rank 1 waited in that collective until --timeout_s. Now the file is left
// as it is, every rank stops at once, and rank 0's line says why.
TEST(TrainerSaveTest, AStopWhoseLookCannotStartItsThreadLeavesTheFileAndEndsEveryRank) {
  const std::string checkpoint = TempDir("no_thread_stop") + "/ckpt.safetensors";
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "hung_stop", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .stop_all_on_failure = false,
                    .env = {{"HUNG_STOP_CKPT", checkpoint},
                            {"HUNG_STOP_NO_HANG", "1"},
                            {"HUNG_STOP_NO_THREAD", "1"},
                            {"HUNG_STOP_TIMEOUT_S", "60"}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 0) << run->Summary() << run->Output(rank);
  }
  EXPECT_NE(run->Output(0).find("stopped by Ctrl-C at epoch 1, step 1; cannot look at the header of --checkpoint=" +
                                checkpoint + ", to tell whose file it is ("),
            std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(0).find("), so it was left as it was (this run had saved nothing yet)"), std::string::npos)
      << run->Output(0);
  EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was replaced";
  EXPECT_LT(seconds, 25) << "a rank waited for rank 0's decision until --timeout_s";
}

// A save that keeps another program's file first, then fails with an error
// that is not the disk's (out of memory): the file kept is put back as it
// was, or, where it was renamed (no hard links) and the path is empty now,
// every rank's line says where it is, and what it is (it called any such
// file "another run's checkpoint"). Only a CheckpointSaveError did so:
// any other failure left a second name (.prev) beside the file, or, without
// hard links, the file moved away with no word of where.
TEST(TrainerSaveTest, AFailedSaveThatIsNotTheDisksSaysWhereAnotherRunsFileWent) {
  for (const bool hard_links : {true, false}) {
    const std::string dir = TempDir(hard_links ? "odd_save_linked" : "odd_save_renamed");
    const std::string checkpoint = dir + "/ckpt.safetensors";
    const std::string previous = dir + "/ckpt.prev.safetensors";
    std::ofstream(checkpoint, std::ios::binary) << kForeignSafetensors;
    std::vector<std::pair<std::string, std::string>> env = {{"ODD_SAVE_CKPT", checkpoint},
                                                            {"FAIL_FILE_FSYNC", "1"}};
    if (!hard_links) env.emplace_back("NO_HARD_LINKS", "1");
    auto run = launch::testing::RunTestWorkers(
        "odd_save",
        {.world_size = 2, .timeout = std::chrono::seconds(90), .stop_all_on_failure = false, .env = env});
    ASSERT_TRUE(run.ok()) << run.status();
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
      EXPECT_NE(run->Output(rank).find("rank 0 could not save the checkpoint: std::bad_alloc"), std::string::npos)
          << run->Output(rank);
    }
    if (hard_links) {
      EXPECT_FALSE(std::filesystem::exists(previous)) << "a second name of the file was left behind";
      EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was not put back";
    } else {
      EXPECT_TRUE(ReadFile(previous) == kForeignSafetensors) << "the file was not kept";
      for (int rank = 0; rank < 2; ++rank) {
        EXPECT_NE(run->Output(rank).find("std::bad_alloc (a file this trainer did not write, which was at " +
                                         checkpoint + ", is " + previous + ")"),
                  std::string::npos)
            << run->Output(rank);
      }
    }
  }
}

// Rank 0's search for the name that would keep another program's file
// (FreePreviousCheckpointPath: an lstat of each .prev name) had no
// deadline: an lstat hung in the filesystem held rank 0 while the others
// timed out in their collective without its reason. It is part of the
// look bounded by half of --timeout_s, and every rank fails naming it.
TEST(TrainerSaveTest, AHungLookForTheKeptNameEndsEveryRankNamingIt) {
  const std::string dir = TempDir("lstat_hang");
  const std::string checkpoint = dir + "/ckpt.safetensors";
  std::ofstream(checkpoint, std::ios::binary) << kForeignSafetensors;
  const auto start = std::chrono::steady_clock::now();
  auto run = launch::testing::RunTestWorkers(
      "lstat_hang", {.world_size = 2,
                     .timeout = std::chrono::seconds(90),
                     .stop_all_on_failure = false,
                     .env = {{"LSTAT_HANG_CKPT", checkpoint}, {"LSTAT_HANG_PATH", dir + "/ckpt.prev.safetensors"}}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string reason = "cannot read the header of --checkpoint=" + checkpoint +
                             " within 2.0s (half of --timeout_s), to tell whose file it is, or to find the name "
                             "beside it (" + dir + "/ckpt.prev.safetensors, ...) that keeps it";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find(reason), std::string::npos) << run->Output(rank);
  }
  EXPECT_TRUE(ReadFile(checkpoint) == kForeignSafetensors) << "the file was replaced";
  EXPECT_LT(seconds, 40) << "the 60 s lstat was waited out";
}

// Rank 0's look at the file at --checkpoint failing in the host (EIO) is
// the run's failure (exit status 1), given with the system's reason, not a
// refusal of the flag (2) with advice to choose a writable path: the path
// may be right, on a disk failing for a moment.
TEST(TrainerSaveTest, AnIoErrorLookingAtTheCheckpointPathFailsTheRunNotItsFlag) {
  const std::string checkpoint = TempDir("lstat_fault") + "/ckpt.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "lstat_fault", {.world_size = 2,
                      .timeout = std::chrono::seconds(90),
                      .stop_all_on_failure = false,
                      .env = {{"LSTAT_EIO_PATH", checkpoint}}});
  ASSERT_TRUE(run.ok()) << run.status();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(run->ExitCode(rank), 1) << run->Summary() << run->Output(rank);
    EXPECT_NE(run->Output(rank).find("cannot look at --checkpoint=" + checkpoint + " (" + checkpoint + ": " +
                                     std::strerror(EIO) + "): the host failed, not the path"),
              std::string::npos)
        << run->Output(rank);
    EXPECT_EQ(run->Output(rank).find("choose a writable path"), std::string::npos) << run->Output(rank);
  }
}

// Rank 0's save that fails (here its write: a file too large; a failure
// gathering the checkpoint takes the same way), when the collective that
// tells the others fails too (a peer lost): rank 0's line gives its own
// reason and says the others could not be told. It gave the loss alone
// ("waiting for rank 0: ..."), and why the save failed was lost.
TEST(TrainerSaveTest, RankZerosFailedSaveIsReportedWhenTellingTheOthersFailsToo) {
  const std::string checkpoint = TempDir("lost_save") + "/ckpt.safetensors";
  auto run = launch::testing::RunTestWorkers(
      "lost_save",
      {.world_size = 1, .timeout = std::chrono::seconds(90), .env = {{"LOST_SAVE_CKPT", checkpoint}}});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->ExitCode(0), 1) << run->Summary() << run->Output(0);
  EXPECT_NE(run->Output(0).find("error: rank 0 could not save the checkpoint: cannot save the checkpoint " +
                                checkpoint + ": " + std::strerror(EFBIG) + " ("),
            std::string::npos)
      << run->Output(0);
  EXPECT_NE(run->Output(0).find(" (the other ranks could not be told: waiting for rank 0: a peer was lost (the "
                                "test's))\n"),
            std::string::npos)
      << run->Output(0);
}

// The default --checkpoint is the same path for every run of a model and
// dataset: a fresh run (no --resume) used to replace the earlier run's
// trained model at its first save without a word. It says so at the start,
// and its first save keeps the other run's file under the first free name
// of <stem>.prev.safetensors, <stem>.prev.2.safetensors, ...; its own later
// saves replace only its own. A job without a name (no DDP_JOB_TOKEN or
// run id) cannot tell its own checkpoint from another's, so its restart
// keeps its own too: that one used to replace the .prev kept before, and
// the first run's checkpoint was lost.
TEST(TrainerSaveTest, FreshRunKeepsAnotherRunsCheckpointNeverReplacingOneKeptBefore) {
  const std::string dir = TempDir("fresh");
  const std::string checkpoint = dir + "/mlp_synthetic.safetensors";
  const std::string previous = dir + "/mlp_synthetic.prev.safetensors";
  const std::string second_previous = dir + "/mlp_synthetic.prev.2.safetensors";
  auto run = [&](const std::string& job) {
    auto result = launch::testing::RunTestWorkers(
        "fresh_run", {.world_size = 2,
                      .timeout = std::chrono::seconds(90),
                      .env = {{"FRESH_RUN_CKPT", checkpoint}, {"FRESH_RUN_JOB", job}}});
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : launch::testing::TestRunResult{};
  };
  launch::testing::TestRunResult first = run("job-a");
  ASSERT_TRUE(first.AllSucceeded()) << first.Summary() << first.Output(0) << first.Output(1);
  EXPECT_EQ(first.Output(0).find("another run's"), std::string::npos) << first.Output(0);
  EXPECT_FALSE(std::filesystem::exists(previous));
  const std::string job_a = ReadFile(checkpoint);
  ASSERT_FALSE(job_a.empty());

  // A job without a name, then its restart.
  launch::testing::TestRunResult second = run("");
  ASSERT_TRUE(second.AllSucceeded()) << second.Summary() << second.Output(0) << second.Output(1);
  std::string out = second.Output(0);
  EXPECT_NE(out.find("note: " + checkpoint + " holds another run's checkpoint; this run's first "
                     "save keeps it as " + previous),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("another run's checkpoint, which was at " + checkpoint + ", is now " + previous),
            std::string::npos)
      << out;
  EXPECT_TRUE(ReadFile(previous) == job_a) << "the other run's checkpoint was not kept";
  const std::string unnamed = ReadFile(checkpoint);
  EXPECT_FALSE(unnamed.empty());
  EXPECT_FALSE(unnamed == job_a);

  launch::testing::TestRunResult restart = run("");
  ASSERT_TRUE(restart.AllSucceeded()) << restart.Summary() << restart.Output(0) << restart.Output(1);
  out = restart.Output(0);
  EXPECT_NE(out.find("this run's first save keeps it as " + second_previous), std::string::npos) << out;
  EXPECT_NE(out.find("another run's checkpoint, which was at " + checkpoint + ", is now " +
                     second_previous),
            std::string::npos)
      << out;
  EXPECT_TRUE(ReadFile(previous) == job_a) << "the checkpoint kept before was replaced";
  EXPECT_TRUE(ReadFile(second_previous) == unnamed);
  EXPECT_FALSE(ReadFile(checkpoint).empty());
}

// A fresh run at a file that is not safetensors at all (a PyTorch .pt, a
// text file) keeps it, and its note says what it is without offering
// --resume, which refuses such a file: it said "holds another run's
// checkpoint ... (--resume continues it instead)".
TEST(TrainerSaveTest, AFreshRunAtAFileThatIsNotSafetensorsKeepsItWithoutOfferingResume) {
  const std::string dir = TempDir("not_safetensors");
  const std::string checkpoint = dir + "/mlp_synthetic.safetensors";
  const std::string previous = dir + "/mlp_synthetic.prev.safetensors";
  std::ofstream(checkpoint) << "weights pickled by torch.save";
  auto run = launch::testing::RunTestWorkers(
      "fresh_run", {.world_size = 2,
                    .timeout = std::chrono::seconds(90),
                    .env = {{"FRESH_RUN_CKPT", checkpoint}, {"FRESH_RUN_JOB", "job-a"}}});
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_TRUE(run->AllSucceeded()) << run->Summary() << run->Output(0) << run->Output(1);
  const std::string out = run->Output(0);
  EXPECT_NE(out.find("note: " + checkpoint + " holds a file that does not read as a safetensors file; this run's "
                     "first save keeps it as " + previous + "\n"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("--resume continues it"), std::string::npos) << out;
  EXPECT_EQ(ReadFile(previous), "weights pickled by torch.save");
}

// A fresh run's first save used to move another run's checkpoint aside to
// <stem>.prev.safetensors before it wrote: when that write ran past
// --save_timeout_s (or failed: a full disk), nothing was left at the path,
// and --resume found no checkpoint there. The file stays at the path until
// the new one replaces it, and a save that fails leaves it there as it
// was, under its one name.
TEST(TrainerSaveTest, LateFirstSaveOfAFreshRunLeavesAnotherRunsCheckpointInPlace) {
  const std::string dir = TempDir("fresh_late");
  const std::string checkpoint = dir + "/mlp_synthetic.safetensors";
  const std::string previous = dir + "/mlp_synthetic.prev.safetensors";
  auto run = [&](const char* worker, const std::string& job) {
    auto result = launch::testing::RunTestWorkers(
        worker, {.world_size = 2,
                 .timeout = std::chrono::seconds(90),
                 .stop_all_on_failure = false,
                 .env = {{"FRESH_RUN_CKPT", checkpoint},
                         {"FRESH_RUN_JOB", job},
                         {"FRESH_RUN_PAUSE_MS", "1000"}}});
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : launch::testing::TestRunResult{};
  };
  const launch::testing::TestRunResult first = run("fresh_run", "job-a");
  ASSERT_TRUE(first.AllSucceeded()) << first.Summary() << first.Output(0) << first.Output(1);
  const std::string job_a = ReadFile(checkpoint);
  ASSERT_FALSE(job_a.empty());

  const launch::testing::TestRunResult second = run("fresh_slow_save", "job-b");
  EXPECT_EQ(second.ExitCode(0), 1) << second.Summary();
  const std::string out = second.Output(0);
  EXPECT_NE(out.find("rank 0 was still writing " + checkpoint + " after 1 s (--save_timeout_s); "
                     "the file there is the one before, if any"),
            std::string::npos)
      << out;
  EXPECT_TRUE(ReadFile(checkpoint) == job_a) << "another run's checkpoint is not at its path";
  EXPECT_FALSE(std::filesystem::exists(previous));
}

// A write stuck in the filesystem (here: each piece waits 30 s before it
// looks at its stop flag) used to hold rank 0 after --save_timeout_s until
// the write itself returned, without a bound: RunOnLead joined its thread
// forever, since the write used the Run's own members. The write now owns
// what it uses, so rank 0 leaves it behind --save_stop_grace_s after
// asking it to stop, says so, and fails naming the checkpoint; the file
// at the path is the one saved before (a writer told to stop never
// renames its temporary file into place).
TEST(TrainerSaveTest, WriteStuckInTheFilesystemEndsTheRunAfterTheGraceLeavingTheCheckpointBefore) {
  const std::string checkpoint = TempDir("stuck") + "/ckpt.safetensors";
  auto run = [&](const char* worker) {
    auto result = launch::testing::RunTestWorkers(
        worker, {.world_size = 2,
                 .timeout = std::chrono::seconds(90),
                 .stop_all_on_failure = false,
                 .env = {{"FRESH_RUN_CKPT", checkpoint},
                         {"FRESH_RUN_JOB", "job-a"},
                         {"STUCK_CKPT", checkpoint},
                         {"STUCK_JOB", "job-a"},
                         {"STUCK_PAUSE_MS", "30000"}}});
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : launch::testing::TestRunResult{};
  };
  const launch::testing::TestRunResult first = run("fresh_run");
  ASSERT_TRUE(first.AllSucceeded()) << first.Summary() << first.Output(0) << first.Output(1);
  const std::string before = ReadFile(checkpoint);
  ASSERT_FALSE(before.empty());

  const auto start = std::chrono::steady_clock::now();
  const launch::testing::TestRunResult stuck = run("stuck_save");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Training and the save's 1 s, its 1 s grace, and the ranks' start and
  // end: well under the stuck piece's 30 s.
  EXPECT_LT(seconds, 20) << "rank 0 waited for the stuck write";
  const std::string out = stuck.Output(0);
  EXPECT_EQ(stuck.ExitCode(0), 1) << stuck.Summary() << out;
  EXPECT_NE(out.find("rank 0 was still writing " + checkpoint + " after 1 s (--save_timeout_s); "
                     "the file there is the one before"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("did not end within 1000 ms of being asked to stop"), std::string::npos) << out;
  EXPECT_EQ(stuck.ExitCode(1), 1) << stuck.Summary() << stuck.Output(1);
  EXPECT_TRUE(ReadFile(checkpoint) == before) << "the checkpoint saved before is not at its path";
}

}  // namespace
}  // namespace ddp::examples::trainer
