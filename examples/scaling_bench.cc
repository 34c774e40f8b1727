// Scaling of data-parallel training, as the DDP write-ups tabulate it: the
// same model with the same per-rank batch on 1, 2 and 4 ranks of this
// machine; global samples per second, speed-up over one rank, scaling
// efficiency (speed-up / ranks), and DDP's view of communication (its
// share of forward + backward time, and how much of it backward hid; the
// overlap column reads "caller" where the ranks ran their collectives on
// the training thread, which backward cannot hide anything behind).
//
//   bazel run -c opt //examples:scaling_bench -- --model=cnn --steps=200 --repeat=3
//       --chart=/tmp/scaling.svg
//
// The binary runs each configuration as its own job: it starts N copies of
// itself (SelfLaunch; this process never touches UCX), the copies train for
// --steps timed steps after 5 warm-up steps, and rank 0 hands its figures
// back through a file. With --repeat, the median (by samples/s) of each rank
// count's successful runs is shown (of an even number, the mean of the two
// middle ones: MedianRun), and the failed ones are counted.
// The rank counts are measured from the smallest, whose rate per rank is the
// baseline of every speed-up and of the chart's linear line.

#include <gflags/gflags.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "examples/own_help.h"
#include "examples/scaling_median.h"
#include "examples/trainer/config.h"
#include "examples/trainer/format.h"
#include "examples/trainer/parallel.h"
#include "examples/trainer/svg_chart.h"
#include "examples/trainer/trainer.h"
#include "examples/user_path.h"
#include "nn/io/atomic_file.h"
#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"

DEFINE_string(model, "cnn", "model: cnn, mlp, resnet18, resnet34, resnet50");
DEFINE_string(dataset, "synthetic",
              "synthetic (generated images the model's shape), fashion_mnist, mnist or cifar10");
DEFINE_string(data_dir, "", "folder of the dataset's files (fashion_mnist, mnist, cifar10)");
DEFINE_string(ranks, "1,2,4",
              "rank counts to measure, comma-separated; the smallest is the speed-ups' baseline");
DEFINE_int64(steps, 200, "timed optimizer steps per run (after 5 warm-up steps)");
DEFINE_int64(batch_size, 64, "samples per rank per step");
DEFINE_double(bucket_cap_mb, 25, "DDP bucket size in MiB");
DEFINE_int32(workers, 1, "data loader threads per rank");
DEFINE_int32(repeat, 1, "runs per rank count; the median of those that succeed is reported");
DEFINE_string(chart, "",
              "also write an SVG chart of samples/s and efficiency to this path (relative: to "
              "the directory `bazel run` was started in)");
DEFINE_string(result_file, "", "internal: where rank 0 of a measured job writes its figures");

namespace {

namespace trainer = ddp::examples::trainer;
namespace launch = ddp::transport::launch;
using trainer::FormatRate;
using trainer::StringPrintf;

constexpr int64_t kWarmupSteps = 5;

using Measurement = ddp::examples::ScalingRun;
using ddp::examples::Percent;

trainer::TrainConfig Config() {
  trainer::TrainConfig c;
  c.model = FLAGS_model;
  c.dataset = FLAGS_dataset;
  c.data_dir = FLAGS_data_dir;
  c.batch_size = FLAGS_batch_size;
  c.bucket_cap_mb = FLAGS_bucket_cap_mb;
  c.workers = FLAGS_workers;
  c.max_steps = kWarmupSteps + FLAGS_steps;
  c.epochs = 1000;  // --steps decides; epochs only bound it
  c.checkpoint.clear();
  if (c.model.rfind("resnet", 0) == 0) c.lr = 0.1;
  trainer::ResolvePaths(c);
  return c;
}

// One rank of a measured job.
int RunWorker() {
  trainer::RunOptions options;
  options.quiet = true;
  options.print_result = false;
  options.evaluate = false;
  try {
    auto parallel = trainer::JoinJob();
    const trainer::RunResult r = trainer::Train(Config(), *parallel, options);
    if (parallel->rank() == 0 && !FLAGS_result_file.empty()) {
      const double step_ms =
          1000.0 * FLAGS_batch_size * r.world_size / r.samples_per_s;
      const std::string text =
          StringPrintf("%.17g %.17g %.17g %.17g %d\n", r.samples_per_s, step_ms, r.comm_share,
                       r.comm_overlap, parallel->CollectivesOnCaller() ? 1 : 0);
      ddp::nn::io::AtomicFileWriter out(FLAGS_result_file);
      out.Write(text.data(), text.size());
      out.Commit();
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaling_bench: %s\n", e.what());
    return 1;
  }
}

// Runs a job of `ranks` ranks and reads rank 0's figures.
Measurement Measure(int ranks, const std::vector<std::string>& base_args, const std::string& dir,
                    int index) {
  Measurement m;
  m.ranks = ranks;
  const std::string result = dir + "/result_" + std::to_string(index);
  std::vector<std::string> args = base_args;
  args.push_back("--result_file=" + result);
  args.push_back("--nproc_per_node=" + std::to_string(ranks));
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  launch::SelfLaunchOptions options;
  options.prefix_output = true;
  auto launched = launch::SelfLaunch(argc, argv.data(), options);
  // SelfLaunch catches SIGINT, SIGTERM, SIGHUP and SIGQUIT, passes them to
  // the workers and reports the group as 128 + the signal: stop the
  // benchmark on any of them (SIGHUP and SIGQUIT were taken for a failed
  // run, and every remaining job was started after a hang-up).
  const int signal_number = launched.ok() ? launched->exit_code - 128 : 0;
  if (signal_number == SIGINT || signal_number == SIGTERM || signal_number == SIGHUP ||
      signal_number == SIGQUIT) {
    std::filesystem::remove_all(dir);
    std::exit(launched->exit_code);
  }
  if (!launched.ok() || launched->exit_code != 0) {
    std::fprintf(stderr, "scaling_bench: the %d-rank run failed%s\n", ranks,
                 launched.ok() ? "" : (": " + launched.status().message()).c_str());
    return m;
  }
  // strtod reads "nan" (no communication with one rank); operator>> does not.
  std::ifstream in(result);
  std::string f[5];
  if (!(in >> f[0] >> f[1] >> f[2] >> f[3] >> f[4])) {
    std::fprintf(stderr, "scaling_bench: the %d-rank run left no figures\n", ranks);
    return m;
  }
  m.samples_per_s = std::strtod(f[0].c_str(), nullptr);
  m.step_ms = std::strtod(f[1].c_str(), nullptr);
  m.comm_share = std::strtod(f[2].c_str(), nullptr);
  m.overlap = std::strtod(f[3].c_str(), nullptr);
  m.on_caller = f[4] == "1";
  m.ok = std::isfinite(m.samples_per_s) && m.samples_per_s > 0;
  return m;
}

// Why `path` (--chart, resolved) cannot take the chart, or "": checked
// before the runs, so that a typo costs nothing.
std::string ChartPathProblem(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string flag = "--chart=" + FLAGS_chart;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return flag + " is a folder; give the path of an .svg file";
  // The chart is written beside the path and renamed over it, which nn::io
  // refuses for anything but a regular file: found here, not after the runs.
  const fs::file_type type = fs::status(path, ec).type();
  if (type != fs::file_type::not_found && type != fs::file_type::regular && !ec) {
    return flag + " is " +
           (type == fs::file_type::fifo     ? "a FIFO"
            : type == fs::file_type::socket ? "a socket"
                                            : "a device or other special file") +
           ", not a regular file, and the chart would replace it; give the path of an .svg file";
  }
  const fs::path folder = fs::path(path).parent_path();
  if (!fs::exists(folder, ec)) return flag + ": the folder " + folder.string() + " does not exist";
  if (!fs::is_directory(folder, ec)) return flag + ": " + folder.string() + " is not a folder";
  if (access(folder.c_str(), W_OK | X_OK) != 0) {
    return flag + ": the folder " + folder.string() + " is not writable (" + std::strerror(errno) +
           ")";
  }
  return "";
}

// `base`: samples/s per rank of the smallest rank count measured.
void WriteChart(const std::vector<Measurement>& rows, double base, const std::string& path) {
  trainer::Chart chart;
  chart.title = "Scaling: " + FLAGS_model + " on " + FLAGS_dataset;
  chart.subtitle = StringPrintf("batch %lld per rank, %lld timed steps, %u cores",
                                static_cast<long long>(FLAGS_batch_size),
                                static_cast<long long>(FLAGS_steps),
                                std::thread::hardware_concurrency());
  chart.x_label = "ranks";
  trainer::ChartPanel rate;
  rate.y_label = "samples/s (all ranks)";
  rate.y_from_zero = true;
  trainer::ChartSeries measured{"measured", trainer::kTrainLossColor, {}, true, false};
  trainer::ChartSeries ideal{"linear", "#999999", {}, false, true};
  trainer::ChartPanel eff;
  eff.y_label = "scaling efficiency";
  eff.percent = true;
  eff.y_from_zero = true;
  trainer::ChartSeries efficiency{"efficiency", trainer::kAccuracyColor, {}, true, false};
  for (const Measurement& m : rows) {
    if (!m.ok) continue;
    measured.points.emplace_back(m.ranks, m.samples_per_s);
    ideal.points.emplace_back(m.ranks, base * m.ranks);
    efficiency.points.emplace_back(m.ranks, m.samples_per_s / (base * m.ranks));
  }
  rate.series = {measured, ideal};
  eff.series = {efficiency};
  chart.panels = {rate, eff};
  chart.panel_height = 220;
  const std::string svg = trainer::RenderSvgChart(chart);
  ddp::nn::io::AtomicFileWriter out(path);
  out.Write(svg.data(), svg.size());
  out.Commit();
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("samples/s, speed-up and scaling efficiency of DDP training on 1, 2, 4 ranks");
  // gflags' --help lists the flags of every linked library and exits 1:
  // this program's flags instead.
  if (ddp::examples::ShowOwnHelpIfAsked(argc, argv, "examples/scaling_bench")) return 0;
  if (const std::string problem = ddp::examples::CommandLineProblem(&argc, &argv, "examples/scaling_bench");
      !problem.empty()) {
    std::fprintf(stderr, "scaling_bench: %s\n", problem.c_str());
    return 2;
  }
  std::vector<std::string> original(argv, argv + argc);
  gflags::ParseCommandLineFlags(&argc, &argv, true);

  // A worker of a measured job: started by Measure (through SelfLaunch),
  // always with --result_file. Launch variables without it mean the user
  // started this coordinator under a launcher, which would make it one
  // silent worker.
  if (launch::HasLaunchVariables(launch::CurrentEnvironment())) {
    if (!FLAGS_result_file.empty()) return RunWorker();
    std::fprintf(stderr,
                 "scaling_bench: launch variables are set (RANK, WORLD_SIZE, an srun step or "
                 "mpirun); scaling_bench starts its own jobs: run it outside "
                 "srun/mpirun/torchrun/ddprun\n");
    return 2;
  }

  std::vector<int> counts;
  for (size_t pos = 0; pos <= FLAGS_ranks.size();) {
    size_t end = FLAGS_ranks.find(',', pos);
    if (end == std::string::npos) end = FLAGS_ranks.size();
    // Strictly a whole decimal number: atoi read "1 2 4" as 1 and "2x" as 2.
    const std::string item = FLAGS_ranks.substr(pos, end - pos);
    char* item_end = nullptr;
    errno = 0;
    const long n = item.empty() || !std::isdigit(static_cast<unsigned char>(item[0]))
                       ? 0
                       : std::strtol(item.c_str(), &item_end, 10);
    if (item_end == nullptr || *item_end != '\0' || errno != 0 || n < 1 || n > 256) {
      std::fprintf(stderr,
                   "scaling_bench: --ranks=%s: each count must be a whole number in [1, 256], "
                   "comma-separated\n",
                   FLAGS_ranks.c_str());
      return 2;
    }
    counts.push_back(static_cast<int>(n));
    pos = end + 1;
  }
  // Smallest first: its result is the baseline of the rows printed after it.
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  // The flag and its value, as every other refusal names them.
  if (FLAGS_steps < 1) {
    std::fprintf(stderr, "scaling_bench: --steps=%lld must be at least 1\n", static_cast<long long>(FLAGS_steps));
    return 2;
  }
  if (FLAGS_repeat < 1) {
    std::fprintf(stderr, "scaling_bench: --repeat=%d must be at least 1\n", FLAGS_repeat);
    return 2;
  }
  // The runs count the warm-up steps too (Config): a larger --steps would
  // wrap that sum round to a negative step limit.
  if (FLAGS_steps > INT64_MAX - kWarmupSteps) {
    std::fprintf(stderr, "scaling_bench: --steps=%lld must be at most %lld (%lld warm-up steps come first)\n",
                 static_cast<long long>(FLAGS_steps), static_cast<long long>(INT64_MAX - kWarmupSteps),
                 static_cast<long long>(kWarmupSteps));
    return 2;
  }
  const std::string chart = ddp::examples::UserPath(FLAGS_chart);
  if (!chart.empty()) {
    if (const std::string problem = ChartPathProblem(chart); !problem.empty()) {
      std::fprintf(stderr, "scaling_bench: %s\n", problem.c_str());
      return 2;
    }
  }
  try {
    trainer::TrainConfig c = Config();
    trainer::ValidateConfig(c);
    for (int n : counts) trainer::CheckSetup(c, n);
  } catch (const trainer::UsageError& e) {
    std::fprintf(stderr, "scaling_bench: %s\n", e.what());
    return 2;
  }

  // The workers get the same flags (minus ours, which are appended anew).
  std::vector<std::string> base_args;
  for (const std::string& a : original) {
    if (a.rfind("--result_file", 0) == 0 || a.rfind("--nproc_per_node", 0) == 0) continue;
    base_args.push_back(a);
  }
  // The runs' result files, in $TMPDIR as other programs' temporary files
  // (it was always /tmp).
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") + "/scaling_bench.XXXXXX";
  const char* dir = mkdtemp(tmpl.data());
  if (dir == nullptr) {
    std::fprintf(stderr, "scaling_bench: cannot make a folder %s: %s\n", tmpl.c_str(), std::strerror(errno));
    return 1;
  }

  const unsigned cores = std::thread::hardware_concurrency();
  // Every flag that changes the figures, so that a saved table says what
  // it measured (--bucket_cap_mb and --workers were left out).
  std::printf("# scaling_bench: %s on %s, batch %lld per rank, %lld timed steps after %lld "
              "warm-up, median of %d, %u cores, buckets of %g MiB, %d loader thread%s per rank; "
              "overlap \"caller\": collectives ran on the training thread, so none of them hid "
              "behind backward\n",
              FLAGS_model.c_str(), FLAGS_dataset.c_str(), static_cast<long long>(FLAGS_batch_size),
              static_cast<long long>(FLAGS_steps), static_cast<long long>(kWarmupSteps),
              FLAGS_repeat, cores, FLAGS_bucket_cap_mb, FLAGS_workers, FLAGS_workers == 1 ? "" : "s");
  std::printf("%5s %11s %8s %10s %10s %8s %8s\n", "ranks", "samples/s", "speed-up", "efficiency",
              "comm", "overlap", "step_ms");
  std::fflush(stdout);
  std::vector<Measurement> rows;
  // Samples/s per rank of the smallest rank count with a result: set once,
  // so that every speed-up and the chart divide by the same figure.
  double base = NAN;
  int index = 0;
  int failed_runs = 0;
  for (int n : counts) {
    // The median of the runs that finished: a failed run has no rate, and
    // counting it would shift the median towards the slowest success.
    std::vector<Measurement> ok;
    for (int r = 0; r < FLAGS_repeat; ++r) {
      Measurement m = Measure(n, base_args, dir, index++);
      if (m.ok) ok.push_back(m);
    }
    const int failed = FLAGS_repeat - static_cast<int>(ok.size());
    failed_runs += failed;
    if (ok.empty()) {
      rows.push_back(Measurement{.ranks = n});
      std::printf("%5d %11s\n", n, FLAGS_repeat == 1 ? "failed" : "all failed");
      std::fflush(stdout);
      continue;
    }
    const Measurement m = ddp::examples::MedianRun(ok);
    rows.push_back(m);
    if (!std::isfinite(base)) base = m.samples_per_s / n;
    const double speedup = m.samples_per_s / base;
    std::string notes;
    if (failed > 0) {
      notes += StringPrintf("  (median of %zu; %d of %d runs failed)", ok.size(), failed,
                            FLAGS_repeat);
    }
    if (static_cast<unsigned>(n) > cores) notes += "  (more ranks than cores)";
    std::printf("%5d %11s %7.2fx %10s %10s %8s %8.1f%s\n", n, FormatRate(m.samples_per_s).c_str(),
                speedup, Percent(speedup / n).c_str(), n == 1 ? "-" : Percent(m.comm_share).c_str(),
                n == 1        ? "-"
                : m.on_caller ? "caller"
                              : Percent(m.overlap).c_str(),
                m.step_ms, notes.c_str());
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  if (!chart.empty() && std::isfinite(base)) {
    try {
      WriteChart(rows, base, chart);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "scaling_bench: cannot write --chart=%s: %s\n", chart.c_str(), e.what());
      return 1;
    }
    std::printf("# chart: %s\n", chart.c_str());
  }
  return failed_runs > 0 ? 1 : 0;
}
