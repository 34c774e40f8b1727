// Collectives on CUDA device buffers between real processes sharing one GPU
// (run on a GPU machine: tag "gpu", --config=cuda). The test binary spawns
// copies of itself as the ranks (DDP_TEST_SCENARIO names what they run);
// each rank fills device buffers from closed-form inputs, runs the
// collective on the device pointers, copies the result back and compares it
// with the closed-form result.

#include <cuda_runtime.h>
#include <signal.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "transport/communicator.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/process_group.h"

namespace ddp::transport {
namespace {

using std::chrono::milliseconds;
using testing::CountWrong;
using testing::EnvOr;
using testing::FillInput;
using testing::InputValue;
using testing::Job;
using testing::Load;
using testing::RunJob;

void MustCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "CUDA %s: %s\n", what, cudaGetErrorString(status));
    std::exit(4);
  }
}

// A device buffer of `bytes` plus one guard byte, filled with 0x5A.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    MustCuda(cudaMalloc(&data_, bytes + 1), "cudaMalloc");
    MustCuda(cudaMemset(data_, 0x5A, bytes + 1), "cudaMemset");
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::byte* get() const { return static_cast<std::byte*>(data_); }
  void Upload(const std::vector<char>& host, size_t offset = 0) {
    MustCuda(cudaMemcpy(get() + offset, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
  }
  // The whole buffer and its guard byte.
  std::vector<char> Download() const {
    std::vector<char> host(bytes_ + 1);
    MustCuda(cudaMemcpy(host.data(), data_, bytes_ + 1, cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

std::unique_ptr<Communicator> MustCreate() {
  int devices = 0;
  MustCuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  const int local_rank = std::atoi(EnvOr("LOCAL_RANK", "0").c_str());
  MustCuda(cudaSetDevice(local_rank % devices), "cudaSetDevice");
  CommunicatorOptions options;
  options.timeout = milliseconds(std::atoi(EnvOr("DDP_TEST_TIMEOUT_MS", "30000").c_str()));
  options.chunk_bytes = std::strtoul(EnvOr("DDP_TEST_CHUNK_BYTES", "0").c_str(), nullptr, 10);
  options.device_chunk_bytes =
      std::strtoul(EnvOr("DDP_TEST_DEVICE_CHUNK_BYTES", "0").c_str(), nullptr, 10);
  auto comm = Communicator::CreateFromEnvironment(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "CREATE %s\n", comm.status().ToString().c_str());
    std::exit(3);
  }
  return std::move(*comm);
}

void SweepAllReduce(Communicator& comm, Algorithm algorithm, const std::vector<size_t>& counts) {
  const int n = comm.size();
  for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (size_t count : counts) {
        for (bool in_place : {true, false}) {
          const size_t bytes = count * DataTypeSize(dtype);
          std::vector<char> input(bytes);
          FillInput(dtype, input.data(), count, comm.rank(), op);
          DeviceBuffer send(bytes), recv(bytes);
          send.Upload(input);
          DeviceBuffer& out = in_place ? send : recv;
          Status s = comm.AllReduce(send.get(), out.get(), count, dtype, op, {.algorithm = algorithm});
          const std::string what = std::string("device all-reduce ") + AlgorithmName(algorithm) +
                                   " " + DataTypeName(dtype) + " " + ReduceOpName(op) +
                                   " count " + std::to_string(count) +
                                   (in_place ? " in place" : "");
          WORKER_CHECK(s.ok(), what + ": " + s.ToString());
          if (!s.ok()) return;
          const std::vector<char> result = out.Download();
          std::string first;
          WORKER_CHECK(CountWrong(dtype, result.data(), count, n, op, 0, &first) == 0,
                       what + ": " + first);
          WORKER_CHECK(result[bytes] == 0x5A, what + ": wrote past the end");
          if (!in_place) {
            WORKER_CHECK(send.Download() == [&] { auto v = input; v.push_back(0x5A); return v; }(),
                         what + ": changed the send buffer");
          }
        }
      }
    }
  }
}

void SweepOthers(Communicator& comm, const std::vector<size_t>& counts) {
  const int n = comm.size(), me = comm.rank();
  for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kBF16}) {
    const size_t elem = DataTypeSize(dtype);
    for (size_t count : counts) {
      const std::string suffix = std::string(" ") + DataTypeName(dtype) + " count " +
                                 std::to_string(count);
      // Broadcast from every root.
      for (int root = 0; root < n; ++root) {
        std::vector<char> input(count * elem);
        FillInput(dtype, input.data(), count, me == root ? 0 : 5, ReduceOp::kMax);
        DeviceBuffer buf(count * elem);
        buf.Upload(input);
        Status s = comm.Broadcast(buf.get(), count, dtype, root);
        WORKER_CHECK(s.ok(), "device broadcast: " + s.ToString());
        const std::vector<char> result = buf.Download();
        size_t wrong = 0;
        for (size_t i = 0; i < count; ++i) {
          wrong += testing::Load(dtype, result.data(), i) != testing::InputValue(0, i, ReduceOp::kMax);
        }
        WORKER_CHECK(wrong == 0, "device broadcast from " + std::to_string(root) + suffix + ": " +
                                     std::to_string(wrong) + " wrong");
        WORKER_CHECK(result[count * elem] == 0x5A, "device broadcast wrote past the end");
      }
      // All-gather, out of place and in place.
      for (bool in_place : {false, true}) {
        std::vector<char> mine(count * elem);
        FillInput(dtype, mine.data(), count, me, ReduceOp::kSum);
        DeviceBuffer all(n * count * elem), own(count * elem);
        const std::byte* send = own.get();
        if (in_place) {
          all.Upload(mine, me * count * elem);
          send = all.get() + me * count * elem;
        } else {
          own.Upload(mine);
        }
        Status s = comm.AllGather(send, all.get(), count, dtype);
        WORKER_CHECK(s.ok(), "device all-gather: " + s.ToString());
        const std::vector<char> result = all.Download();
        size_t wrong = 0;
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            wrong += testing::Load(dtype, result.data(), r * count + i) !=
                     testing::InputValue(r, i, ReduceOp::kSum);
          }
        }
        WORKER_CHECK(wrong == 0, std::string("device all-gather") + (in_place ? " in place" : "") +
                                     suffix + ": " + std::to_string(wrong) + " wrong");
        WORKER_CHECK(result[n * count * elem] == 0x5A, "device all-gather wrote past the end");
      }
      // Reduce-scatter: rank r gets block r of the reduction.
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        std::vector<char> input(n * count * elem);
        FillInput(dtype, input.data(), n * count, me, op);
        DeviceBuffer send(n * count * elem), recv(count * elem);
        send.Upload(input);
        Status s = comm.ReduceScatter(send.get(), recv.get(), count, dtype, op);
        WORKER_CHECK(s.ok(), "device reduce-scatter: " + s.ToString());
        const std::vector<char> result = recv.Download();
        std::string first;
        WORKER_CHECK(CountWrong(dtype, result.data(), count, n, op, me * count, &first) == 0,
                     std::string("device reduce-scatter ") + ReduceOpName(op) + suffix + ": " + first);
        WORKER_CHECK(result[count * elem] == 0x5A, "device reduce-scatter wrote past the end");
      }
    }
  }
}

// Send/Recv around a ring with device buffers (staged when UCX cannot move
// device memory), and async all-reduces on device buffers in issue order.
void PointToPointAndAsync(Communicator& comm) {
  const int n = comm.size(), me = comm.rank();
  if (n > 1) {
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    std::vector<char> mine(777 * 8);
    FillInput(DataType::kI64, mine.data(), 777, me, ReduceOp::kSum);
    DeviceBuffer out(mine.size()), in(mine.size());
    out.Upload(mine);
    // Even ranks send first, odd ranks receive first: blocking calls only.
    Status a = me % 2 == 0 ? comm.Send(out.get(), 777, DataType::kI64, next, 42)
                           : comm.Recv(in.get(), 777, DataType::kI64, prev, 42);
    Status b = me % 2 == 0 ? comm.Recv(in.get(), 777, DataType::kI64, prev, 42)
                           : comm.Send(out.get(), 777, DataType::kI64, next, 42);
    WORKER_CHECK(a.ok() && b.ok(), "device send/recv: " + a.ToString() + " " + b.ToString());
    const std::vector<char> got = in.Download();
    size_t wrong = 0;
    for (size_t i = 0; i < 777; ++i) {
      wrong += testing::Load(DataType::kI64, got.data(), i) != testing::InputValue(prev, i, ReduceOp::kSum);
    }
    WORKER_CHECK(wrong == 0, "device recv: " + std::to_string(wrong) + " wrong");
    if (!comm.info().ucx_cuda_memory) {
      Work w = comm.SendAsync(out.get(), 777, DataType::kI64, next, 43);
      Status s = w.Wait();
      WORKER_CHECK(s.code() == StatusCode::kInvalidArgument &&
                       s.message().find("device memory") != std::string::npos,
                   "device SendAsync without CUDA UCX: " + s.ToString());
    }
  }
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<Work> works;
  for (int i = 0; i < 4; ++i) {
    std::vector<char> input(3000 * 4);
    FillInput(DataType::kF32, input.data(), 3000, me, ReduceOp::kSum);
    buffers.push_back(std::make_unique<DeviceBuffer>(input.size()));
    buffers.back()->Upload(input);
    works.push_back(comm.AllReduceAsync(buffers.back()->get(), buffers.back()->get(), 3000,
                                        DataType::kF32, ReduceOp::kSum));
  }
  for (size_t i = 0; i < works.size(); ++i) {
    Status s = works[i].Wait();
    WORKER_CHECK(s.ok(), "device async all-reduce: " + s.ToString());
    const std::vector<char> result = buffers[i]->Download();
    WORKER_CHECK(CountWrong(DataType::kF32, result.data(), 3000, n, ReduceOp::kSum) == 0,
                 "device async all-reduce " + std::to_string(i) + " result");
  }
}

int ScenarioSweep() {
  auto comm = MustCreate();
  const size_t n = comm->size();
  const std::vector<size_t> counts = {0, 1, n - 1, 1001, 6000};
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                      Algorithm::kSharedMemory}) {
    SweepAllReduce(*comm, a, counts);
  }
  SweepOthers(*comm, counts);
  PointToPointAndAsync(*comm);
  if (comm->rank() == 0) {
    std::printf("INFO ranks=%d shm=%d ucx_cuda=%d\n", comm->size(), comm->info().shared_memory,
                comm->info().ucx_cuda_memory);
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// Staged all-reduce and reduce-scatter with each reduction placement
// (CallOptions::staged_reduce), every dtype and op, against the closed form
// and against the same call on host buffers (reduced by the host's
// kernels), which must agree bit for bit: the inputs are small integers.
int ScenarioStagedModes() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  const std::vector<size_t> counts = {1, static_cast<size_t>(n - 1), 1001};
  const DataType types[] = {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                            DataType::kI32, DataType::kI64, DataType::kU8};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin,
                          ReduceOp::kProd};
  for (StagedReduce where : {StagedReduce::kDevice, StagedReduce::kHost}) {
    const CallOptions call{.staged_reduce = where};
    const std::string mode = where == StagedReduce::kDevice ? "device-reduce" : "host-reduce";
    for (DataType dtype : types) {
      const size_t elem = DataTypeSize(dtype);
      for (ReduceOp op : ops) {
        for (size_t count : counts) {
          if (count == 0) continue;
          const std::string suffix = " " + mode + " " + DataTypeName(dtype) + " " +
                                     ReduceOpName(op) + " count " + std::to_string(count);
          // All-reduce, out of place.
          std::vector<char> input(count * elem);
          FillInput(dtype, input.data(), count, me, op);
          DeviceBuffer send(input.size()), recv(input.size());
          send.Upload(input);
          Status s = comm->AllReduce(send.get(), recv.get(), count, dtype, op, call);
          WORKER_CHECK(s.ok(), "staged all-reduce" + suffix + ": " + s.ToString());
          if (!s.ok()) return 1;
          std::vector<char> host = input;
          s = comm->AllReduce(host.data(), count, dtype, op);
          WORKER_CHECK(s.ok(), "host all-reduce" + suffix + ": " + s.ToString());
          std::vector<char> got = recv.Download();
          std::string first;
          WORKER_CHECK(CountWrong(dtype, got.data(), count, n, op, 0, &first) == 0,
                       "staged all-reduce" + suffix + ": " + first);
          WORKER_CHECK(std::memcmp(got.data(), host.data(), host.size()) == 0,
                       "staged all-reduce" + suffix + ": differs from the host buffers' result");
          WORKER_CHECK(got[input.size()] == 0x5A, "staged all-reduce" + suffix + ": wrote past the end");
          // Reduce-scatter: rank r gets block r.
          std::vector<char> blocks(n * count * elem);
          FillInput(dtype, blocks.data(), n * count, me, op);
          DeviceBuffer rs_send(blocks.size()), rs_recv(count * elem);
          rs_send.Upload(blocks);
          s = comm->ReduceScatter(rs_send.get(), rs_recv.get(), count, dtype, op, call);
          WORKER_CHECK(s.ok(), "staged reduce-scatter" + suffix + ": " + s.ToString());
          if (!s.ok()) return 1;
          got = rs_recv.Download();
          WORKER_CHECK(CountWrong(dtype, got.data(), count, n, op, me * count, &first) == 0,
                       "staged reduce-scatter" + suffix + ": " + first);
          WORKER_CHECK(got[count * elem] == 0x5A,
                       "staged reduce-scatter" + suffix + ": wrote past the end");
        }
      }
    }
  }
  if (me == 0) {
    std::printf("INFO ranks=%d staged_reduce=%d ucx_cuda=%d\n", n,
                static_cast<int>(comm->info().staged_reduce), comm->info().ucx_cuda_memory);
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// One large all-reduce at the default chunk size (several 4 MiB chunks).
int ScenarioLarge() {
  auto comm = MustCreate();
  const size_t count = size_t{5} << 20;  // 20 MiB of f32
  std::vector<char> input(count * 4);
  FillInput(DataType::kF32, input.data(), count, comm->rank(), ReduceOp::kSum);
  DeviceBuffer buf(input.size());
  buf.Upload(input);
  for (StagedReduce where : {StagedReduce::kDevice, StagedReduce::kHost}) {
    for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing}) {
      buf.Upload(input);
      Status s = comm->AllReduce(buf.get(), count, DataType::kF32, ReduceOp::kSum,
                                 {.algorithm = a, .staged_reduce = where});
      WORKER_CHECK(s.ok(), "large device all-reduce: " + s.ToString());
      const std::vector<char> result = buf.Download();
      std::string first;
      WORKER_CHECK(CountWrong(DataType::kF32, result.data(), count, comm->size(), ReduceOp::kSum,
                              0, &first) == 0,
                   std::string("large device all-reduce ") + AlgorithmName(a) +
                       (where == StagedReduce::kDevice ? " device-reduce: " : " host-reduce: ") +
                       first);
    }
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// Reduce, Gather, Scatter and all-to-all on device buffers, staged through
// the host slots (the job sets small slots, so many chunks), for every root;
// results against the closed forms, the guard byte after each device output
// intact. Ranks off the root pass null for the buffer they do not use.
int ScenarioRootedDevice() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  const size_t count = 1001, bytes = count * 4;
  const auto f32 = DataType::kF32;
  std::vector<char> mine(bytes), all(bytes * n);
  FillInput(f32, mine.data(), count, me, ReduceOp::kSum);
  FillInput(f32, all.data(), count * n, me, ReduceOp::kSum);
  DeviceBuffer send(bytes), whole(bytes * n);
  send.Upload(mine);
  whole.Upload(all);
  for (int root = 0; root < n; ++root) {
    const std::string at = " (root " + std::to_string(root) + ")";
    const bool is_root = me == root;
    DeviceBuffer gathered(bytes * n), reduced(bytes), part(bytes);
    Status s = comm->Reduce(send.get(), is_root ? reduced.get() : nullptr, count, f32,
                            ReduceOp::kSum, root);
    WORKER_CHECK(s.ok(), "device reduce" + at + ": " + s.ToString());
    if (is_root) {
      const std::vector<char> out = reduced.Download();
      std::string first;
      WORKER_CHECK(CountWrong(f32, out.data(), count, n, ReduceOp::kSum, 0, &first) == 0 &&
                       out[bytes] == 0x5A,
                   "device reduce" + at + ": " + first);
    }
    s = comm->GatherAsync(send.get(), is_root ? gathered.get() : nullptr, count, f32, root).Wait();
    WORKER_CHECK(s.ok(), "device gather" + at + ": " + s.ToString());
    if (is_root) {
      const std::vector<char> out = gathered.Download();
      size_t wrong = 0;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < count; ++i) {
          wrong += Load(f32, out.data(), r * count + i) != InputValue(r, i, ReduceOp::kSum);
        }
      }
      WORKER_CHECK(wrong == 0 && out[bytes * n] == 0x5A,
                   "device gather" + at + ": " + std::to_string(wrong) + " wrong");
    }
    s = comm->Scatter(is_root ? whole.get() : nullptr, part.get(), count, f32, root);
    WORKER_CHECK(s.ok(), "device scatter" + at + ": " + s.ToString());
    const std::vector<char> out = part.Download();
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      wrong += Load(f32, out.data(), i) != InputValue(root, me * count + i, ReduceOp::kSum);
    }
    WORKER_CHECK(wrong == 0 && out[bytes] == 0x5A,
                 "device scatter" + at + ": " + std::to_string(wrong) + " wrong");
  }
  // All-to-all: block q of this rank's `whole` goes to rank q.
  DeviceBuffer exchanged(bytes * n);
  Status s = comm->AllToAll(whole.get(), exchanged.get(), count, f32);
  WORKER_CHECK(s.ok(), "device all-to-all: " + s.ToString());
  const std::vector<char> out = exchanged.Download();
  size_t wrong = 0;
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < count; ++i) {
      wrong +=
          Load(f32, out.data(), q * count + i) != InputValue(q, me * count + i, ReduceOp::kSum);
    }
  }
  WORKER_CHECK(wrong == 0 && out[bytes * n] == 0x5A,
               "device all-to-all: " + std::to_string(wrong) + " wrong");
  return testing::worker_failures == 0 ? 0 : 1;
}

// All-reduces on device buffers in a loop until something fails; reports
// how it failed.
int ScenarioLoop() {
  auto comm = MustCreate();
  const Algorithm algorithm = static_cast<Algorithm>(std::atoi(EnvOr("DDP_TEST_ALGO", "0").c_str()));
  const size_t count = 1 << 20;
  DeviceBuffer buf(count * 4);
  MustCuda(cudaMemset(buf.get(), 0, count * 4), "cudaMemset");
  const auto until = Clock::now() + std::chrono::seconds(30);
  auto last_ok = Clock::now();
  std::printf("READY\n");
  std::fflush(stdout);
  while (Clock::now() < until) {
    Status s = comm->AllReduce(buf.get(), count, DataType::kF32, ReduceOp::kSum,
                               {.algorithm = algorithm});
    if (!s.ok()) {
      const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - last_ok).count();
      std::printf("ERROR %s after_ms=%lld\n", s.ToString().c_str(), static_cast<long long>(ms));
      Status again = comm->AllReduce(buf.get(), count, DataType::kF32, ReduceOp::kSum);
      std::printf("AGAIN %s same=%d\n", again.ToString().c_str(), again == comm->aborted_reason());
      return 0;
    }
    last_ok = Clock::now();
  }
  return 1;
}

// CUDA IPC on, but rank 0's buffer comes from a stream-ordered pool
// (cudaMallocAsync), which the legacy IPC API cannot export: every rank must
// learn it in the same call and stage instead, with correct results.
int ScenarioIpcDeclined() {
  auto comm = MustCreate();
  const size_t count = 1001;
  std::vector<char> input(count * 4);
  FillInput(DataType::kF32, input.data(), count, comm->rank(), ReduceOp::kSum);
  void* data = nullptr;
  if (comm->rank() == 0) {
    MustCuda(cudaMallocAsync(&data, input.size(), nullptr), "cudaMallocAsync");
  } else {
    MustCuda(cudaMalloc(&data, input.size()), "cudaMalloc");
  }
  MustCuda(cudaMemcpy(data, input.data(), input.size(), cudaMemcpyHostToDevice), "upload");
  for (int round = 0; round < 3; ++round) {
    MustCuda(cudaMemcpy(data, input.data(), input.size(), cudaMemcpyHostToDevice), "upload");
    Status s = comm->AllReduce(data, count, DataType::kF32, ReduceOp::kSum);
    WORKER_CHECK(s.ok(), "all-reduce with IPC declined: " + s.ToString());
    std::vector<char> result(input.size());
    MustCuda(cudaMemcpy(result.data(), data, result.size(), cudaMemcpyDeviceToHost), "download");
    std::string first;
    WORKER_CHECK(CountWrong(DataType::kF32, result.data(), count, comm->size(), ReduceOp::kSum, 0,
                            &first) == 0,
                 "all-reduce with IPC declined: " + first);
  }
  if (comm->rank() == 0) {
    MustCuda(cudaFreeAsync(data, nullptr), "cudaFreeAsync");
    MustCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } else {
    cudaFree(data);
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// Review fixes, on a GPU: (1) a chunk size that is no multiple of the
// alignment (DDP_TEST_DEVICE_CHUNK_BYTES=4097: slot 1 and scratch 1 used
// to start misaligned); (2) inputs written on the legacy default stream
// and not synchronized, read by every path (staged, or a CUDA-aware UCX's
// direct broadcast, all-gather and Send/Recv, which now drain the staging
// stream first); (3) last, rank 0 passes a host send buffer and a device
// receive buffer: refused locally naming both, no kernel touches the host
// buffer (no sticky CUDA error), and the others learn of the abort.
int ScenarioOrderingAndMixed() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  // (1) Several misaligned-before chunks, both reduction placements.
  for (StagedReduce where : {StagedReduce::kDevice, StagedReduce::kHost}) {
    for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kF16}) {
      const size_t count = 5000, elem = DataTypeSize(dtype);
      std::vector<char> input(count * elem);
      FillInput(dtype, input.data(), count, me, ReduceOp::kSum);
      DeviceBuffer buf(input.size());
      buf.Upload(input);
      Status s = comm->AllReduce(buf.get(), count, dtype, ReduceOp::kSum,
                                 {.staged_reduce = where});
      WORKER_CHECK(s.ok(), "odd chunk all-reduce " + std::string(DataTypeName(dtype)) + ": " +
                               s.ToString());
      if (!s.ok()) return 1;
      std::string first;
      const std::vector<char> got = buf.Download();
      WORKER_CHECK(CountWrong(dtype, got.data(), count, n, ReduceOp::kSum, 0, &first) == 0,
                   "odd chunk all-reduce " + std::string(DataTypeName(dtype)) + ": " + first);
    }
  }
  // (2) 16 MiB written by an asynchronous memset on the legacy default
  // stream just before each call (thousands of 4352-byte chunks when
  // staged).
  const size_t bytes = size_t{16} << 20;
  DeviceBuffer big(bytes), gathered(bytes * n);
  auto check_bytes = [&](const DeviceBuffer& b, size_t offset, size_t len, int value,
                         const std::string& what) {
    const std::vector<char> got = b.Download();
    size_t wrong = 0;
    for (size_t i = offset; i < offset + len; ++i) wrong += got[i] != static_cast<char>(value);
    WORKER_CHECK(wrong == 0, what + ": " + std::to_string(wrong) + " bytes not yet written");
  };
  MustCuda(cudaMemsetAsync(big.get(), me == 0 ? 0x11 : 0x22, bytes, nullptr), "memset");
  Status s = comm->Broadcast(big.get(), bytes, DataType::kU8, 0);
  WORKER_CHECK(s.ok(), "broadcast after a memset: " + s.ToString());
  if (!s.ok()) return 1;
  check_bytes(big, 0, bytes, 0x11, "broadcast after a memset");
  MustCuda(cudaMemsetAsync(big.get(), 0x30 + me, bytes, nullptr), "memset");
  s = comm->AllGather(big.get(), gathered.get(), bytes, DataType::kU8);
  WORKER_CHECK(s.ok(), "all-gather after a memset: " + s.ToString());
  if (!s.ok()) return 1;
  for (int r = 0; r < n; ++r) {
    check_bytes(gathered, r * bytes, bytes, 0x30 + r, "all-gather after a memset");
  }
  if (n >= 2 && me < 2) {
    MustCuda(cudaMemsetAsync(big.get(), me == 0 ? 0x44 : 0x55, bytes, nullptr), "memset");
    s = me == 0 ? comm->Send(big.get(), bytes, DataType::kU8, 1, 7)
                : comm->Recv(big.get(), bytes, DataType::kU8, 0, 7);
    WORKER_CHECK(s.ok(), "send/recv after a memset: " + s.ToString());
    if (!s.ok()) return 1;
    check_bytes(big, 0, bytes, 0x44, "send/recv after a memset");
  }
  // (3) Mixed memory in one call: rank 0 refuses and aborts.
  const size_t count = 1000;
  std::vector<float> host(count, 1.0f);
  DeviceBuffer recv(count * 4);
  s = me == 0 ? comm->AllReduce(host.data(), recv.get(), count, DataType::kF32, ReduceOp::kSum)
              : comm->AllReduce(recv.get(), recv.get(), count, DataType::kF32, ReduceOp::kSum);
  WORKER_CHECK(!s.ok(), "mixed host/device all-reduce succeeded");
  if (me == 0) {
    WORKER_CHECK(s.code() == StatusCode::kInvalidArgument, "mixed: " + s.ToString());
    WORKER_CHECK(s.message().find("the send buffer is host memory and the receive buffer is on "
                                  "CUDA device") != std::string::npos,
                 "mixed: " + s.ToString());
  } else {
    WORKER_CHECK(s.message().find("rank 0") != std::string::npos, "mixed: " + s.ToString());
  }
  WORKER_CHECK(cudaDeviceSynchronize() == cudaSuccess, "a CUDA error after the mixed call");
  return testing::worker_failures == 0 ? 0 : 1;
}

int RunScenario(const std::string& name) {
  if (name == "ordering_and_mixed") return ScenarioOrderingAndMixed();
  if (name == "ipc_declined") return ScenarioIpcDeclined();
  if (name == "sweep") return ScenarioSweep();
  if (name == "large") return ScenarioLarge();
  if (name == "staged_modes") return ScenarioStagedModes();
  if (name == "loop") return ScenarioLoop();
  if (name == "rooted_device") return ScenarioRootedDevice();
  std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
  return 2;
}

// ------------------------------------------------------------- parent ----

// How long a job may run: device jobs start CUDA in every rank.
constexpr milliseconds kJobLimit(120000);

class DeviceSweep : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// Every collective, dtype and algorithm on device buffers, with staging
// chunks of 512 bytes so that most counts take several chunks; staged
// reductions on the device (the default) and on the host.
TEST_P(DeviceSweep, EveryCollectiveOnDeviceBuffers) {
  const auto& [ranks, staged_reduce] = GetParam();
  Job job = RunJob(ranks, "sweep",
                   {{"DDP_TEST_DEVICE_CHUNK_BYTES", "512"}, {"DDP_TEST_CHUNK_BYTES", "1024"},
                    {"DDP_STAGED_REDUCE", staged_reduce}},
                   kJobLimit);
  ASSERT_EQ(job.results.size(), static_cast<size_t>(ranks));
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
  EXPECT_NE(job.results[0].output.find("INFO ranks="), std::string::npos) << job.Describe();
}

// The host placement with 2 ranks only: DeviceStagedModes covers it with 4.
INSTANTIATE_TEST_SUITE_P(RanksAndReduction, DeviceSweep,
                         ::testing::Values(std::make_tuple(2, "device"),
                                           std::make_tuple(4, "device"),
                                           std::make_tuple(2, "host")));

class DeviceStagedModes : public ::testing::TestWithParam<int> {};

// Both staged reduction placements in one job, every dtype and op, against
// the closed form and the host buffers' result.
TEST_P(DeviceStagedModes, DeviceAndHostReductionMatchTheCpu) {
  Job job = RunJob(GetParam(), "staged_modes", {{"DDP_TEST_DEVICE_CHUNK_BYTES", "512"}},
                   kJobLimit);
  ASSERT_EQ(job.results.size(), static_cast<size_t>(GetParam()));
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
  EXPECT_NE(job.results[0].output.find("INFO ranks="), std::string::npos) << job.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceStagedModes, ::testing::Values(2, 4));

class DeviceIpcSweep : public ::testing::TestWithParam<int> {};

// The same sweep with CUDA IPC on: ranks sharing one GPU reach each
// other's buffers, so every collective goes GPU to GPU.
TEST_P(DeviceIpcSweep, EveryCollectiveOverCudaIpc) {
  Job job = RunJob(GetParam(), "sweep",
                   {{"DDP_CUDA_IPC", "1"}, {"DDP_TEST_DEVICE_CHUNK_BYTES", "512"},
                    {"DDP_TEST_CHUNK_BYTES", "1024"}},
                   kJobLimit);
  ASSERT_EQ(job.results.size(), static_cast<size_t>(GetParam()));
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceIpcSweep, ::testing::Values(2, 4));

TEST(DeviceCollectives, IpcDeclinedByOneRankStagesOnEveryRank) {
  Job job = RunJob(3, "ipc_declined", {{"DDP_CUDA_IPC", "1"}}, kJobLimit);
  ASSERT_EQ(job.results.size(), 3u);
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

// See ScenarioOrderingAndMixed. With a CUDA-aware UCX (UCX_TLS with
// cuda_copy) the broadcast, all-gather and Send/Recv go direct.
TEST(DeviceCollectives, OddChunksStreamOrderAndMixedMemory) {
  Job job = RunJob(3, "ordering_and_mixed", {{"DDP_TEST_DEVICE_CHUNK_BYTES", "4097"}},
                   kJobLimit);
  ASSERT_EQ(job.results.size(), 3u);
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

TEST(DeviceCollectives, RootedCollectivesAndAllToAllStageDeviceBuffers) {
  for (int n : {2, 3}) {
    Job job = RunJob(n, "rooted_device", {{"DDP_TEST_DEVICE_CHUNK_BYTES", "512"}}, kJobLimit);
    ASSERT_EQ(job.results.size(), static_cast<size_t>(n));
    for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
  }
}

TEST(DeviceCollectives, LargeAllReduceAtTheDefaultChunkSize) {
  Job job = RunJob(2, "large", {}, kJobLimit);
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

// A rank killed while the others all-reduce device buffers: every survivor
// reports PEER_LOST naming it within the deadline, and later calls fail at
// once with the same reason. `staged_reduce` is host by default, so that
// the algorithm named is the one that runs (device reductions exchange
// segments directly, whatever the algorithm).
void ExpectSurvivorsReport(int n, Algorithm algorithm, bool ipc = false,
                           const std::string& staged_reduce = "host") {
  const milliseconds timeout(3000);
  const int victim = n - 1;
  Job job = RunJob(n, "loop",
                   {{"DDP_TEST_ALGO", std::to_string(static_cast<int>(algorithm))},
                    {"DDP_TEST_TIMEOUT_MS", std::to_string(timeout.count())},
                    {"DDP_CUDA_IPC", ipc ? "1" : "0"},
                    {"DDP_STAGED_REDUCE", staged_reduce}},
                   milliseconds(60000), [&](testing::ProcessGroup& group, int) {
                     // CUDA start-up takes a while: kill once every rank
                     // is in its loop.
                     group.WaitForOutput("READY", DeadlineIn(milliseconds(40000)));
                     std::this_thread::sleep_for(milliseconds(500));
                     group.Kill(victim, SIGKILL);
                   });
  ASSERT_EQ(job.results.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (r == victim) continue;
    const auto& result = job.results[r];
    ASSERT_EQ(result.exit_code, 0) << job.Describe();
    EXPECT_NE(result.output.find("ERROR PEER_LOST"), std::string::npos) << job.Describe();
    EXPECT_NE(result.output.find("rank " + std::to_string(victim)), std::string::npos)
        << job.Describe();
    const size_t at = result.output.find("after_ms=");
    ASSERT_NE(at, std::string::npos) << job.Describe();
    EXPECT_LE(std::atoi(result.output.c_str() + at + 9), timeout.count() + 1000) << job.Describe();
    EXPECT_NE(result.output.find("same=1"), std::string::npos) << job.Describe();
  }
}

TEST(DeviceFaults, PeerKilledDuringSharedMemoryAllReduce) {
  ExpectSurvivorsReport(2, Algorithm::kSharedMemory);
}
TEST(DeviceFaults, PeerKilledDuringUcxRingAllReduce) { ExpectSurvivorsReport(4, Algorithm::kRing); }
TEST(DeviceFaults, PeerKilledDuringDeviceReduceExchange) {
  ExpectSurvivorsReport(3, Algorithm::kAuto, /*ipc=*/false, "device");
}
TEST(DeviceFaults, PeerKilledDuringCudaIpcAllReduce) {
  ExpectSurvivorsReport(3, Algorithm::kAuto, /*ipc=*/true);
}

}  // namespace
}  // namespace ddp::transport

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv, ddp::transport::RunScenario);
}
