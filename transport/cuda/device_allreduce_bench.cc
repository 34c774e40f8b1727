// All-reduce on device buffers against the same all-reduce on host buffers,
// in one job, to measure what staging through pinned host memory costs, how
// much of the copying the chunk pipeline hides, and where the staged
// reduction is better done (--staged_reduce: on the device, on the host, or
// both side by side). Needs a GPU.
//
//   bazel run --config=cuda //transport/cuda:device_allreduce_bench --
//       --nproc_per_node=2 --device_chunk_bytes=4194304 --staged_reduce=both
// (one command line)
//
// Rank 0 prints a '#' header, then one line per size and memory kind:
//   bytes memory time_us algbw_GBps busbw_GBps copy_us wrong
// memory: "device/device-reduce", "device/host-reduce" or "host".
// copy_us: one unpipelined device->host plus host->device copy of the whole
// buffer on this rank, the cost the pipeline tries to hide.

#include <cuda_runtime.h>
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "transport/communicator.h"
#include "transport/launch/self_launch.h"
#include "transport/testing/expected_values.h"

DEFINE_int64(min_bytes, 4096, "smallest message in bytes");
DEFINE_int64(max_bytes, 256 << 20, "largest message in bytes");
DEFINE_double(step_factor, 4, "multiply the size by this between lines");
DEFINE_int32(iters, 20, "timed calls per size");
DEFINE_int32(warmup_iters, 2, "untimed calls per size");
DEFINE_int64(device_chunk_bytes, 0, "staging chunk per slot (0: the default, 4 MiB)");
DEFINE_string(memory, "both", "device, host or both");
DEFINE_string(algo, "auto", "auto, ring, tree, rhd, shm (host reductions only)");
DEFINE_string(dtype, "f32", "element type: f32, f64, f16, bf16, i32, i64 or u8");
DEFINE_string(staged_reduce, "both",
              "device buffers: where the staged all-reduce reduces: device, host or both");

namespace ddp::transport {
namespace {

using Seconds = std::chrono::duration<double>;

void Must(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "CUDA %s: %s\n", what, cudaGetErrorString(status));
    std::exit(4);
  }
}

Algorithm ParseAlgo(const std::string& name) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                      Algorithm::kSharedMemory}) {
    if (name == AlgorithmName(a)) return a;
  }
  std::fprintf(stderr, "--algo=%s: expected auto, ring, tree, rhd or shm\n", name.c_str());
  std::exit(2);
}

DataType ParseDtype(const std::string& name) {
  for (DataType t : {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16, DataType::kI32,
                     DataType::kI64, DataType::kU8}) {
    if (name == DataTypeName(t)) return t;
  }
  std::fprintf(stderr, "--dtype=%s: expected f32, f64, f16, bf16, i32, i64 or u8\n", name.c_str());
  std::exit(2);
}

int Run() {
  int devices = 0;
  Must(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  const char* local = std::getenv("LOCAL_RANK");
  Must(cudaSetDevice((local ? std::atoi(local) : 0) % devices), "cudaSetDevice");
  CommunicatorOptions options;
  options.device_chunk_bytes = static_cast<size_t>(FLAGS_device_chunk_bytes);
  options.bind_to_core = true;
  auto created = Communicator::CreateFromEnvironment(options);
  if (!created.ok()) {
    std::fprintf(stderr, "creating the communicator: %s\n", created.status().ToString().c_str());
    return 3;
  }
  Communicator& comm = **created;
  const Algorithm algorithm = ParseAlgo(FLAGS_algo);
  const DataType dtype = ParseDtype(FLAGS_dtype);
  const size_t element = DataTypeSize(dtype);
  const int n = comm.size();
  if (comm.rank() == 0) {
    std::printf("# ranks=%d devices=%d ucx_cuda=%d device_chunk_bytes=%lld algo=%s "
                "staged_reduce=%s dtype=%s\n",
                n, devices, comm.info().ucx_cuda_memory,
                static_cast<long long>(FLAGS_device_chunk_bytes), FLAGS_algo.c_str(),
                FLAGS_staged_reduce.c_str(), DataTypeName(dtype));
    std::printf("# bytes memory time_us algbw_GBps busbw_GBps copy_us wrong\n");
  }
  if (FLAGS_staged_reduce != "device" && FLAGS_staged_reduce != "host" &&
      FLAGS_staged_reduce != "both") {
    std::fprintf(stderr, "--staged_reduce=%s: expected device, host or both\n",
                 FLAGS_staged_reduce.c_str());
    return 2;
  }
  // Label, and where a staged call reduces (unused for host memory).
  std::vector<std::pair<std::string, StagedReduce>> kinds;
  if (FLAGS_memory != "host") {
    if (FLAGS_staged_reduce != "host") {
      kinds.emplace_back("device/device-reduce", StagedReduce::kDevice);
    }
    if (FLAGS_staged_reduce != "device") {
      kinds.emplace_back("device/host-reduce", StagedReduce::kHost);
    }
  }
  if (FLAGS_memory != "device") kinds.emplace_back("host", StagedReduce::kAuto);
  for (double size = FLAGS_min_bytes; size <= FLAGS_max_bytes; size *= FLAGS_step_factor) {
    const size_t count = std::max<size_t>(1, static_cast<size_t>(size) / element);
    const size_t bytes = count * element;
    std::vector<char> input(bytes), output(bytes);
    testing::FillInput(dtype, input.data(), count, comm.rank(), ReduceOp::kSum);
    void* device = nullptr;
    Must(cudaMalloc(&device, bytes), "cudaMalloc");
    // The copy cost alone, for reference.
    const auto copy_start = std::chrono::steady_clock::now();
    Must(cudaMemcpy(output.data(), device, bytes, cudaMemcpyDeviceToHost), "copy");
    Must(cudaMemcpy(device, output.data(), bytes, cudaMemcpyHostToDevice), "copy");
    const double copy_us = Seconds(std::chrono::steady_clock::now() - copy_start).count() * 1e6;
    for (const auto& [kind, where] : kinds) {
      const bool on_device = kind != "host";
      void* buffer = on_device ? device : output.data();
      auto reset = [&] {
        if (on_device) {
          Must(cudaMemcpy(device, input.data(), bytes, cudaMemcpyHostToDevice), "upload");
        } else {
          output = input;
        }
      };
      double total = 0;
      size_t wrong = 0;
      for (int i = 0; i < FLAGS_warmup_iters + FLAGS_iters; ++i) {
        reset();
        Status s = comm.Barrier();
        const auto start = std::chrono::steady_clock::now();
        if (s.ok()) {
          s = comm.AllReduce(buffer, count, dtype, ReduceOp::kSum,
                             {.algorithm = algorithm, .staged_reduce = where});
        }
        const double seconds = Seconds(std::chrono::steady_clock::now() - start).count();
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: all-reduce of %zu bytes: %s\n", comm.rank(), bytes,
                       s.ToString().c_str());
          return 1;
        }
        if (i >= FLAGS_warmup_iters) total += seconds;
      }
      std::vector<char> result(bytes);
      if (on_device) {
        Must(cudaMemcpy(result.data(), device, bytes, cudaMemcpyDeviceToHost), "download");
      } else {
        result = output;
      }
      wrong = testing::CountWrong(dtype, result.data(), count, n, ReduceOp::kSum);
      const double us = total / FLAGS_iters * 1e6;
      const double algbw = bytes / (us * 1e-6) / 1e9;
      if (comm.rank() == 0) {
        std::printf("%zu %s %.1f %.3f %.3f %.1f %zu\n", bytes, kind.c_str(), us, algbw,
                    algbw * 2.0 * (n - 1) / n, copy_us, wrong);
        std::fflush(stdout);
      }
    }
    cudaFree(device);
  }
  return 0;
}

}  // namespace
}  // namespace ddp::transport

int main(int argc, char** argv) {
  ddp::transport::launch::SelfLaunchOrExit(argc, argv);
  gflags::SetUsageMessage("device-buffer all-reduce benchmark; --nproc_per_node=N spawns N ranks");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return ddp::transport::Run();
}
