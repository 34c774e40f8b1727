// All-reduce benchmark in the manner of nccl-tests' all_reduce_perf.
//
//   bazel run //examples:allreduce_bench -- --nproc_per_node=2
//       --min_bytes=4096 --max_bytes=64M --step_factor=4 --check   (one line)
//
// Spawns its own ranks (SelfLaunch, before anything touches UCX), or runs as
// one rank of a job started by ddprun/srun/mpirun. Rank 0 prints a header
// line starting with '#', then one line per size:
//
//   bytes count algo time_us algbw_GBps busbw_GBps wrong
//
// time_us is the slowest rank's mean time per call (--time_of=rank0: rank
// 0's own, the figure the MPI and gloo all-reduce peers print, said in the
// header); algbw = bytes / time;
// busbw = algbw * 2(n-1)/n, the bytes each rank's links must carry, which
// makes figures comparable across rank counts; wrong counts mismatched
// elements over all ranks with --check (else 0). With --check, a run that
// found any wrong element says so on stderr and exits 1.
//
// --collective=broadcast times broadcasts from --root instead (in place;
// busbw = algbw, as nccl-tests counts it; algo is "-"). --collective=alltoall
// times AllToAll: bytes is each rank's whole send buffer (size() blocks),
// busbw = algbw * (n-1)/n as nccl-tests counts it; algo is "-".
//
// Rooted collectives, to and from --root: --collective=reduce times Reduce
// (bytes is each rank's vector; in place on the root with --in_place;
// busbw = algbw, as nccl-tests counts it; --algo=tree|ring|shm forces the
// algorithm, algo "auto" prints what the size gets: shm on one host, else
// tree or ring). --collective=gather and --collective=scatter time Gather
// and Scatter: bytes is the root's whole buffer (size() blocks, as
// all-to-all), busbw = algbw * (n-1)/n (what the root's link carries);
// algo is "-". All-to-all, gather and scatter combine nothing: they refuse
// an --op other than sum, and the header shows "op -". The header's buffer
// mode is the one used: broadcast is always in place, all-to-all, gather and
// scatter never are. --algo applies to allreduce and reduce only, --root to
// broadcast, reduce, gather and scatter: elsewhere they are refused rather
// than printed and ignored.

#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/own_help.h"
#include "examples/setup_signals.h"
#include "transport/communicator.h"
#include "transport/launch/env.h"
#include "transport/launch/self_launch.h"
#include "transport/shm/shareable.h"
#include "transport/testing/expected_values.h"

DEFINE_string(collective, "allreduce",
              "allreduce, broadcast (from --root), alltoall, reduce, gather or scatter");
DEFINE_string(algo, "auto",
              "all-reduce algorithm: auto, ring, tree, rhd, hierarchical, shm; reduce: auto, tree, "
              "ring, shm; other collectives: auto only");
DEFINE_int32(root, 0, "root of broadcast, reduce, gather and scatter");
DEFINE_string(min_bytes, "4", "smallest message (suffixes K, M, G: powers of 1024)");
DEFINE_string(max_bytes, "64M", "largest message");
DEFINE_double(step_factor, 2, "multiply the size by this between lines");
DEFINE_int32(iters, 0, "timed calls per size; 0: 2e8/bytes, between 3 and 200 (as the MPI peer)");
DEFINE_int32(warmup_iters, 2, "untimed calls per size before timing");
DEFINE_string(dtype, "f32", "f32, f64, f16, bf16, i32, i64, u8");
DEFINE_string(op, "sum", "sum, avg, max, min, prod");
DEFINE_bool(check, false, "verify results against closed-form values (reported as 'wrong')");
DEFINE_bool(in_place, true, "reduce in place (else into a separate output buffer)");
DEFINE_bool(shareable, false,
            "buffers in shareable memory (transport/shm/shareable.h): ranks on a host copy "
            "with them through mappings instead of cross-memory attach");
DEFINE_int32(timeout_ms, 120000, "deadline of every call");
DEFINE_string(time_of, "slowest",
              "the time_us printed: slowest (the slowest rank's mean, as nccl-tests) or rank0 "
              "(rank 0's own mean, as the MPI and gloo all-reduce peers print theirs)");
DEFINE_bool(bind, true,
            "pin each rank to one core (local rank modulo the cores it may use), as mpirun "
            "does by default; keeps two ranks from sharing one core's run queue");

namespace {

// A benchmark buffer: a vector, or shareable memory with --shareable.
class HostBuffer {
 public:
  explicit HostBuffer(size_t bytes) {
    if (!FLAGS_shareable) {
      vector_.resize(bytes);
      data_ = vector_.data();
      return;
    }
    auto p = ddp::transport::shm::AllocateShareable(bytes);
    if (!p.ok()) {
      std::fprintf(stderr, "allreduce_bench: --shareable: %s\n", p.status().ToString().c_str());
      std::exit(1);
    }
    data_ = static_cast<char*>(*p);
  }
  ~HostBuffer() {
    if (FLAGS_shareable) ddp::transport::shm::FreeShareable(data_).IgnoreError();
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  char* data() { return data_; }

 private:
  std::vector<char> vector_;
  char* data_ = nullptr;
};

using ddp::transport::Algorithm;
using ddp::transport::Communicator;
using ddp::transport::DataType;
using ddp::transport::ReduceOp;
using ddp::transport::Status;

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "allreduce_bench: %s\n", message.c_str());
  std::exit(2);
}

size_t ParseBytes(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix = end == nullptr ? "" : end;
  if (suffix == "K" || suffix == "k") scale = 1024;
  else if (suffix == "M" || suffix == "m") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g") scale = 1024.0 * 1024 * 1024;
  else if (!suffix.empty()) {
    throw std::invalid_argument("--" + flag + "=" + text + ": expected a number with an optional K, M or G");
  }
  // Also refuses NaN, infinities and sizes past 2^60 bytes, which no size_t holds safely.
  if (end == text.c_str() || !(value >= 0) || !(value * scale <= 0x1p60)) {
    throw std::invalid_argument("--" + flag + "=" + text + ": expected a non-negative size");
  }
  return static_cast<size_t>(value * scale);
}

// MemAvailable from /proc/meminfo in bytes; 0 when it cannot be read.
uint64_t MemAvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return static_cast<uint64_t>(kib) * 1024;
}

template <typename E>
E ParseEnum(const std::string& flag, const std::string& text, std::initializer_list<E> values,
            const char* (*name)(E)) {
  std::string accepted;
  for (E v : values) {
    if (text == name(v)) return v;
    accepted += std::string(accepted.empty() ? "" : ", ") + name(v);
  }
  throw std::invalid_argument("--" + flag + "=" + text + " is not recognised; expected one of " + accepted);
}

void Check(const Status& status, const char* what) {
  if (!status.ok()) Fail(std::string(what) + ": " + status.ToString());
}

// The flags once parsed; ParseFlags found them fine.
struct ParsedFlags {
  Algorithm algo = Algorithm::kAuto;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  size_t min_bytes = 0;
  size_t max_bytes = 0;
};

// Every check that needs the flags alone (not the number of ranks or the
// host's memory); throws std::invalid_argument naming the first wrong one.
ParsedFlags ParseFlags() {
  ParsedFlags flags;
  const Algorithm algo = flags.algo = ParseEnum<Algorithm>(
      "algo", FLAGS_algo,
      {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
       Algorithm::kHierarchical, Algorithm::kSharedMemory},
      ddp::transport::AlgorithmName);
  flags.dtype = ParseEnum<DataType>(
      "dtype", FLAGS_dtype,
      {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16, DataType::kI32,
       DataType::kI64, DataType::kU8},
      ddp::transport::DataTypeName);
  const ReduceOp op = flags.op = ParseEnum<ReduceOp>(
      "op", FLAGS_op, {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd},
      ddp::transport::ReduceOpName);
  flags.min_bytes = ParseBytes("min_bytes", FLAGS_min_bytes);
  flags.max_bytes = ParseBytes("max_bytes", FLAGS_max_bytes);
  if (flags.max_bytes < flags.min_bytes) {
    throw std::invalid_argument("--max_bytes is smaller than --min_bytes");
  }
  if (!std::isfinite(FLAGS_step_factor) || !(FLAGS_step_factor > 1)) {
    char text[64];
    std::snprintf(text, sizeof(text), "%g", FLAGS_step_factor);
    throw std::invalid_argument(std::string("--step_factor=") + text +
                                " must be a finite number greater than 1");
  }
  if (FLAGS_iters < 0 || FLAGS_warmup_iters < 0) {
    throw std::invalid_argument("--iters and --warmup_iters must be >= 0");
  }
  if (FLAGS_time_of != "slowest" && FLAGS_time_of != "rank0") {
    throw std::invalid_argument("--time_of=" + FLAGS_time_of + " is not recognised; expected slowest or rank0");
  }
  // The communicator refuses it too, but in words that name no flag.
  if (FLAGS_timeout_ms < 1) {
    throw std::invalid_argument("--timeout_ms=" + std::to_string(FLAGS_timeout_ms) + " must be at least 1");
  }
  const std::string& collective = FLAGS_collective;
  if (collective != "allreduce" && collective != "broadcast" && collective != "alltoall" &&
      collective != "reduce" && collective != "gather" && collective != "scatter") {
    throw std::invalid_argument("--collective=" + collective +
                                ": expected allreduce, broadcast, alltoall, reduce, gather or scatter");
  }
  const bool alltoall = collective == "alltoall";
  const bool reduce = collective == "reduce";
  const bool gather = collective == "gather";
  const bool scatter = collective == "scatter";
  // Blocks of count / n elements, one per rank, in one rank's buffer.
  const bool blocked = alltoall || gather || scatter;
  // They move data without combining it: an --op would be printed in the
  // header and ignored. (Broadcast's --op chooses its input values, which
  // --check then expects.)
  if (blocked && op != ReduceOp::kSum) {
    throw std::invalid_argument("--op=" + FLAGS_op + " does not apply to --collective=" + collective +
                                ", which reduces nothing; drop --op");
  }
  // --algo chooses all-reduce's and reduce's algorithm only; --root is
  // the root of the rooted collectives only.
  if (reduce && algo != Algorithm::kAuto && algo != Algorithm::kTree && algo != Algorithm::kRing &&
      algo != Algorithm::kSharedMemory) {
    throw std::invalid_argument("--algo=" + FLAGS_algo +
                                " does not apply to --collective=reduce, which runs auto, tree, ring or shm");
  }
  if (algo != Algorithm::kAuto && collective != "allreduce" && !reduce) {
    throw std::invalid_argument("--algo=" + FLAGS_algo + " does not apply to --collective=" + collective +
                                ", which has one algorithm; drop --algo");
  }
  if (FLAGS_root != 0 && (collective == "allreduce" || alltoall)) {
    throw std::invalid_argument("--root=" + std::to_string(FLAGS_root) +
                                " does not apply to --collective=" + collective +
                                ", which has no root; drop --root");
  }
  return flags;
}

// For SelfLaunchOptions::check_arguments: the flags as every rank will
// parse them, checked once in the process that would start the ranks (each
// rank printed its refusal before).
std::string LaunchFlagProblem(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  try {
    ParseFlags();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("all-reduce benchmark; --nproc_per_node=N spawns N ranks");
  // Before the launch, which would start every rank to print gflags' help
  // of every linked library and exit 1: this program's flags, once.
  if (ddp::examples::ShowOwnHelpIfAsked(argc, argv, "examples/allreduce_bench")) return 0;
  // Ctrl-C while the process that starts the ranks checks the flags is
  // said in one line (it ended without a word), as train says it.
  namespace launch = ddp::transport::launch;
  if (!launch::HasLaunchVariables(launch::CurrentEnvironment())) {
    ddp::examples::WatchSetupSignals("allreduce_bench");
  }
  if (const std::string problem = ddp::examples::CommandLineProblem(&argc, &argv, "examples/allreduce_bench");
      !problem.empty()) {
    ddp::examples::StopIfInterruptedInSetup();  // said already: the refusal is beside the point
    std::fprintf(stderr, "allreduce_bench: %s\n", problem.c_str());
    return 2;
  }
  // Only rank 0 prints, in a fixed format: no "[rank] " prefixes.
  launch::SelfLaunchOrExit(argc, argv, {.prefix_output = false, .check_arguments = [](int argc, char** argv) {
                                          std::string problem = LaunchFlagProblem(argc, argv);
                                          ddp::examples::EndSetup();
                                          return problem;
                                        }});
  gflags::ParseCommandLineFlags(&argc, &argv, true);

  ParsedFlags flags;
  try {
    flags = ParseFlags();
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  }
  const Algorithm algo = flags.algo;
  const DataType dtype = flags.dtype;
  const ReduceOp op = flags.op;
  const size_t min_bytes = flags.min_bytes;
  const size_t max_bytes = flags.max_bytes;
  const std::string& collective = FLAGS_collective;
  const bool broadcast = collective == "broadcast";
  const bool alltoall = collective == "alltoall";
  const bool reduce = collective == "reduce";
  const bool gather = collective == "gather";
  const bool scatter = collective == "scatter";
  // Blocks of count / n elements, one per rank, in one rank's buffer.
  const bool blocked = alltoall || gather || scatter;
  const int root = FLAGS_root;
  // Broadcast always runs in place; all-to-all, gather and scatter never do.
  const bool separate = blocked || (!FLAGS_in_place && !broadcast);
  ddp::transport::CallOptions call_options;
  if (reduce) call_options.algorithm = algo;

  ddp::transport::CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(FLAGS_timeout_ms);
  if (!reduce) options.algorithm = algo;
  options.bind_to_core = FLAGS_bind;
  auto created = Communicator::CreateFromEnvironment(options);
  if (!created.ok()) Fail(created.status().ToString());
  Communicator& comm = **created;
  const int n = comm.size();
  if ((broadcast || reduce || gather || scatter) && (root < 0 || root >= n)) {
    // Returning (not exiting) closes the communicator on the way out.
    std::fprintf(stderr, "allreduce_bench: --root=%d is outside [0, %d)\n", root, n);
    return 2;
  }
  const bool is_root = comm.rank() == root;
  const size_t elem = ddp::transport::DataTypeSize(dtype);
  // The smallest message measured is one element (one per rank for the
  // blocked collectives): a --max_bytes below it would time nothing and
  // exit 0 with an empty table.
  {
    const size_t smallest = blocked ? elem * n : elem;
    if (max_bytes < smallest) {
      if (comm.rank() == 0) {
        const std::string what =
            blocked ? "one --dtype=" + FLAGS_dtype + " element per rank, which --collective=" +
                          collective + " moves at least (" + std::to_string(n) + " ranks, " +
                          std::to_string(smallest) + " bytes)"
                    : "one --dtype=" + FLAGS_dtype + " element (" + std::to_string(smallest) + " bytes)";
        std::fprintf(stderr, "allreduce_bench: --max_bytes=%s is less than %s: nothing would be measured\n",
                     FLAGS_max_bytes.c_str(), what.c_str());
        std::fflush(stderr);
      }
      // Every rank refuses alike; the others leave once rank 0 has said
      // why. The launcher stops every rank when the first exits with an
      // error, which came before rank 0's line 4 runs in 40 under load.
      Check(comm.Barrier(), "the barrier after refusing --max_bytes");
      return 2;
    }
  }
  // Each rank holds a buffer of up to --max_bytes, and a second one, for the
  // output, when the collective runs out of place (--in_place=false, and the
  // collectives that move blocks); broadcast and the default in-place
  // reductions need the one. Refused up front rather than left to the
  // kernel's out-of-memory killer; rank 0's reading decides for everyone,
  // so that all ranks agree.
  {
    int64_t available = comm.rank() == 0 ? static_cast<int64_t>(MemAvailableBytes()) : 0;
    Check(comm.Broadcast(&available, 1, DataType::kI64, 0), "sharing MemAvailable");
    const int buffers = separate ? 2 : 1;
    const double need =
        buffers * static_cast<double>(max_bytes) * comm.info().ranks_sharing_kernel;
    if (available > 0 && need > static_cast<double>(available)) {
      char text[320];
      std::snprintf(text, sizeof(text),
                    "--max_bytes=%s needs about %.1f GiB on this host (%s for each of its %d "
                    "ranks); it has %.1f GiB available",
                    FLAGS_max_bytes.c_str(), need / (1 << 30),
                    separate ? "a send and a receive buffer (out of place)"
                             : "one buffer (in place)",
                    comm.info().ranks_sharing_kernel, static_cast<double>(available) / (1 << 30));
      std::fprintf(stderr, "allreduce_bench: %s\n", text);
      return 2;
    }
  }

  if (comm.rank() == 0) {
    std::printf("# allreduce_bench: %s, %d ranks, %d host(s), dtype %s, op %s, %s, shm path %s, "
                "UCX_TLS=%s%s\n",
                collective.c_str(), n, comm.info().num_hosts, FLAGS_dtype.c_str(),
                blocked ? "-" : FLAGS_op.c_str(),
                separate ? "out of place" : "in place",
                comm.info().shared_memory ? "on" : "off", comm.info().ucx_tls.c_str(),
                FLAGS_time_of == "rank0" ? ", time_us of rank 0" : "");
    std::printf("# %10s %12s %6s %10s %10s %10s %6s\n", "bytes", "count", "algo", "time_us",
                "algbw_GBps", "busbw_GBps", "wrong");
    std::fflush(stdout);
  }

  // For tests of --check only: every rank skips the checked all-reduce,
  // reduce or broadcast and takes it as done, as an algorithm that returns
  // OK and writes nothing would.
  const bool skip_checked_call = std::getenv("ALLREDUCE_BENCH_TEST_SKIP_CHECKED_CALL") != nullptr;
  // Every wrong element --check found, over all sizes and ranks.
  int64_t total_wrong = 0;
  // Sizes that round to the message of the previous row are skipped rather
  // than printed again (small sizes of the blocked collectives, which move at
  // least one element per rank, or a --step_factor below 2 on small sizes).
  size_t previous_bytes = 0;
  for (double size = std::max<size_t>(min_bytes, elem); size <= max_bytes; size *= FLAGS_step_factor) {
    const size_t block = std::max<size_t>(1, static_cast<size_t>(size) / elem / n);
    const size_t count = blocked ? block * n : static_cast<size_t>(size) / elem;
    const size_t bytes = count * elem;
    if (bytes == previous_bytes) continue;
    previous_bytes = bytes;
    HostBuffer send(std::max<size_t>(bytes, 1)), recv(separate ? std::max<size_t>(bytes, 1) : 1);
    void* out = separate ? recv.data() : send.data();
    ddp::transport::testing::FillInput(dtype, send.data(), count, comm.rank(), op);
    const int iters = FLAGS_iters > 0 ? FLAGS_iters
                                      : static_cast<int>(std::clamp<double>(2e8 / std::max<size_t>(bytes, 1), 3, 200));
    auto call = [&] {
      if (alltoall) return comm.AllToAll(send.data(), out, block, dtype);
      // In place, a reduce overwrites the root's input with the sum every
      // call: the timing is the same, and --check refills it.
      if (reduce) return comm.Reduce(send.data(), out, count, dtype, op, root, call_options);
      if (gather) return comm.Gather(send.data(), out, block, dtype, root);
      if (scatter) return comm.Scatter(send.data(), out, block, dtype, root);
      return broadcast ? comm.Broadcast(send.data(), count, dtype, root)
                       : comm.AllReduce(send.data(), out, count, dtype, op);
    };
    for (int i = 0; i < FLAGS_warmup_iters; ++i) Check(call(), "warm-up call");
    Check(comm.Barrier(), "barrier");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) Check(call(), collective.c_str());
    const double own_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
    double slowest_seconds = own_seconds;
    Check(comm.AllReduce(&slowest_seconds, 1, DataType::kF64, ReduceOp::kMax), "collecting times");
    // Only rank 0 prints: with --time_of=rank0, its own time.
    const double seconds = FLAGS_time_of == "rank0" ? own_seconds : slowest_seconds;

    int64_t wrong = 0;
    if (FLAGS_check) {
      ddp::transport::testing::FillInput(dtype, send.data(), count, comm.rank(), op);
      if (alltoall) {
        // Element i of the block rank s sends rank d holds (s * 7 + d * 3 + i) % 100.
        auto value = [](int s, int d, size_t i) { return static_cast<double>((s * 7 + d * 3 + i) % 100); };
        for (int d = 0; d < n; ++d) {
          for (size_t i = 0; i < block; ++i) {
            ddp::transport::testing::Store(dtype, send.data(), d * block + i, value(comm.rank(), d, i));
          }
        }
        Check(comm.AllToAll(send.data(), out, block, dtype), "checked all-to-all");
        for (int s = 0; s < n; ++s) {
          for (size_t i = 0; i < block; ++i) {
            wrong += ddp::transport::testing::Load(dtype, out, s * block + i) != value(s, comm.rank(), i);
          }
        }
      } else if (reduce) {
        // Out of place, the root's output still holds the timed calls'
        // (correct) result: a checked call that wrote nothing would pass.
        if (separate && is_root) {
          ddp::transport::testing::FillUnexpected(dtype, out, count, n, op);
        }
        Check(skip_checked_call ? Status()
                                : comm.Reduce(send.data(), out, count, dtype, op, root, call_options),
              "checked reduce");
        if (is_root) {
          wrong = static_cast<int64_t>(ddp::transport::testing::CountWrong(dtype, out, count, n, op));
        }
      } else if (gather || scatter) {
        // Gather: rank q's block holds (q * 7 + i) % 100; the root's buffer
        // gets them in rank order. Scatter: the root sends those blocks.
        auto value = [](int q, size_t i) { return static_cast<double>((q * 7 + i) % 100); };
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < block; ++i) {
            const double v = gather ? value(comm.rank(), i) : value(q, i);
            ddp::transport::testing::Store(dtype, send.data(), q * block + i, v);
          }
        }
        if (gather) {
          Check(comm.Gather(send.data(), out, block, dtype, root), "checked gather");
          for (int q = 0; q < n && is_root; ++q) {
            for (size_t i = 0; i < block; ++i) {
              wrong += ddp::transport::testing::Load(dtype, out, q * block + i) != value(q, i);
            }
          }
        } else {
          Check(comm.Scatter(send.data(), out, block, dtype, root), "checked scatter");
          for (size_t i = 0; i < block; ++i) {
            wrong += ddp::transport::testing::Load(dtype, out, i) != value(comm.rank(), i);
          }
        }
      } else if (broadcast) {
        // Every rank ends with the root's input, filled for `op`. The other
        // ranks start from values that differ from it everywhere: their own
        // inputs equal the root's on some ranks (every other rank for prod,
        // every seventh for the others), where a broadcast that wrote
        // nothing would pass.
        if (!is_root) {
          const bool integer = dtype == DataType::kI32 || dtype == DataType::kI64 || dtype == DataType::kU8;
          for (size_t i = 0; i < count; ++i) {
            ddp::transport::testing::Store(
                dtype, send.data(), i,
                integer ? ddp::transport::testing::InputValue(root, i, op) + 1 : std::nan(""));
          }
        }
        Check(skip_checked_call ? Status() : comm.Broadcast(send.data(), count, dtype, root),
              "checked broadcast");
        for (size_t i = 0; i < count; ++i) {
          wrong += ddp::transport::testing::Load(dtype, send.data(), i) !=
                   ddp::transport::testing::InputValue(root, i, op);
        }
      } else {
        // As for reduce: out of place, the timed calls left the right values.
        if (separate) ddp::transport::testing::FillUnexpected(dtype, out, count, n, op);
        Check(skip_checked_call ? Status() : comm.AllReduce(send.data(), out, count, dtype, op),
              "checked all-reduce");
        // For tests of the failure path only: rank 0 spoils one element of
        // its result, as a broken algorithm would.
        if (comm.rank() == 0 && count > 0 && std::getenv("ALLREDUCE_BENCH_TEST_CORRUPT") != nullptr) {
          ddp::transport::testing::Store(dtype, out, 0,
                                         ddp::transport::testing::Load(dtype, out, 0) + 1);
        }
        wrong = static_cast<int64_t>(ddp::transport::testing::CountWrong(dtype, out, count, n, op));
      }
      Check(comm.AllReduce(&wrong, 1, DataType::kI64, ReduceOp::kSum), "collecting errors");
      total_wrong += wrong;
    }
    if (comm.rank() == 0) {
      const double algbw = bytes / seconds / 1e9;
      const double busbw = broadcast || reduce ? algbw
                           : blocked           ? algbw * (n - 1) / n
                                               : algbw * 2.0 * (n - 1) / n;
      const char* algo_name =
          reduce                 ? ddp::transport::AlgorithmName(
                                       comm.SelectedReduceAlgorithm(bytes, call_options.algorithm))
          : broadcast || blocked ? "-"
                                 : ddp::transport::AlgorithmName(comm.SelectedAlgorithm(bytes));
      std::printf("%12zu %12zu %6s %10.2f %10.3f %10.3f %6lld\n", bytes, count, algo_name,
                  seconds * 1e6,
                  algbw, busbw, static_cast<long long>(wrong));
      std::fflush(stdout);
    }
  }
  // Every rank holds the same total (each size's count was all-reduced).
  if (total_wrong > 0) {
    if (comm.rank() == 0) {
      std::fprintf(stderr, "allreduce_bench: --check found %lld wrong element(s) in all\n",
                   static_cast<long long>(total_wrong));
      std::fflush(stderr);
    }
    // The others leave once rank 0 has said so: the launcher stops every
    // rank when the first exits with an error, which could otherwise come
    // before rank 0's line.
    Check(comm.Barrier(), "the barrier after --check's count");
    return 1;
  }
  return 0;
}
