// Reduce, Gather and Scatter between real processes over UCX (and through
// the shared-memory engine, which is on by default on one host): the test
// binary spawns copies of itself as the ranks of a one-host job
// (DDP_TEST_SCENARIO names what they run) and checks their exit codes and
// output.

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "transport/communicator.h"
#include "transport/testing/data_types.h"
#include "transport/testing/expected_values.h"
#include "transport/testing/process_group.h"

namespace ddp::transport {
namespace {

using std::chrono::milliseconds;
using testing::CountWrong;
using testing::EnvOr;
using testing::FillInput;
using testing::kAllDataTypes;
using testing::Job;
using testing::RunJob;

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

// ------------------------------------------------------------ workers ----

std::unique_ptr<Communicator> MustCreate() {
  CommunicatorOptions options;
  options.timeout = milliseconds(std::atoi(EnvOr("DDP_TEST_TIMEOUT_MS", "20000").c_str()));
  options.chunk_bytes = std::strtoul(EnvOr("DDP_TEST_CHUNK_BYTES", "0").c_str(), nullptr, 10);
  auto comm = Communicator::CreateFromEnvironment(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "CREATE %s\n", comm.status().ToString().c_str());
    std::exit(3);
  }
  return std::move(*comm);
}

// Rank q's gather block and the root's scatter block for rank q: distinct
// per rank and element, exact in every dtype (u8 included).
double BlockValue(int q, size_t i) { return static_cast<double>((q * 37 + i) % 101); }

void CheckReduce(Communicator& comm, int root, size_t count, DataType dtype, ReduceOp op,
                 bool in_place, Algorithm algorithm) {
  const int n = comm.size(), me = comm.rank();
  const bool is_root = me == root;
  const size_t bytes = count * DataTypeSize(dtype);
  std::vector<char> send(bytes + 1, 0x11), recv(bytes + 1, 0x5A);
  FillInput(dtype, send.data(), count, me, op);
  const std::vector<char> input = send;
  void* out = in_place && is_root ? send.data() : recv.data();
  // Off the root the output is ignored: pass null on odd ranks.
  if (!is_root && me % 2 == 1) out = nullptr;
  Status s = comm.Reduce(send.data(), out, count, dtype, op, root, {.algorithm = algorithm});
  const std::string what = std::string("reduce ") + AlgorithmName(algorithm) + " root " +
                           std::to_string(root) + " " + DataTypeName(dtype) + " " +
                           ReduceOpName(op) + " count " + std::to_string(count) +
                           (in_place ? " in place" : "");
  WORKER_CHECK(s.ok(), what + ": " + s.ToString());
  if (!s.ok()) return;
  if (is_root) {
    std::string first;
    WORKER_CHECK(CountWrong(dtype, out, count, n, op, 0, &first) == 0, what + ": " + first);
    WORKER_CHECK(static_cast<char*>(out)[bytes] == (in_place ? 0x11 : 0x5A),
                 what + ": wrote past the end");
  } else {
    WORKER_CHECK(send == input, what + ": changed the send buffer");
    WORKER_CHECK(recv[0] == 0x5A, what + ": wrote into the ignored output");
  }
}

void CheckGather(Communicator& comm, int root, size_t count, DataType dtype, bool in_place,
                 bool async) {
  const int n = comm.size(), me = comm.rank();
  const bool is_root = me == root;
  const size_t es = DataTypeSize(dtype);
  std::vector<char> mine(count * es), all(n * count * es + 1, 0x5A);
  for (size_t i = 0; i < count; ++i) testing::Store(dtype, mine.data(), i, BlockValue(me, i));
  const void* send = mine.data();
  if (is_root && in_place && count > 0) {
    std::memcpy(all.data() + me * count * es, mine.data(), count * es);
    send = all.data() + me * count * es;
  }
  void* recv = is_root ? all.data() : nullptr;
  Status s = async ? comm.GatherAsync(send, recv, count, dtype, root).Wait()
                   : comm.Gather(send, recv, count, dtype, root);
  const std::string what = "gather root " + std::to_string(root) + " " + DataTypeName(dtype) +
                           " count " + std::to_string(count) + (in_place ? " in place" : "") +
                           (async ? " async" : "");
  WORKER_CHECK(s.ok(), what + ": " + s.ToString());
  if (!s.ok() || !is_root) return;
  size_t wrong = 0;
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < count; ++i) {
      wrong += testing::Load(dtype, all.data(), q * count + i) != BlockValue(q, i);
    }
  }
  WORKER_CHECK(wrong == 0, what + ": " + std::to_string(wrong) + " wrong");
  WORKER_CHECK(all[n * count * es] == 0x5A, what + ": wrote past the end");
}

void CheckScatter(Communicator& comm, int root, size_t count, DataType dtype, bool in_place,
                  bool async) {
  const int n = comm.size(), me = comm.rank();
  const bool is_root = me == root;
  const size_t es = DataTypeSize(dtype);
  std::vector<char> all(n * count * es), got(count * es + 1, 0x5A);
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < count; ++i) {
      testing::Store(dtype, all.data(), q * count + i, is_root ? BlockValue(q, i) : -1.0);
    }
  }
  const std::vector<char> before = all;
  void* recv = is_root && in_place ? all.data() + me * count * es : got.data();
  const void* send = is_root ? all.data() : nullptr;
  Status s = async ? comm.ScatterAsync(send, recv, count, dtype, root).Wait()
                   : comm.Scatter(send, recv, count, dtype, root);
  const std::string what = "scatter root " + std::to_string(root) + " " + DataTypeName(dtype) +
                           " count " + std::to_string(count) + (in_place ? " in place" : "") +
                           (async ? " async" : "");
  WORKER_CHECK(s.ok(), what + ": " + s.ToString());
  if (!s.ok()) return;
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) wrong += testing::Load(dtype, recv, i) != BlockValue(me, i);
  WORKER_CHECK(wrong == 0, what + ": " + std::to_string(wrong) + " wrong");
  WORKER_CHECK(got[count * es] == 0x5A, what + ": wrote past the end");
  if (is_root) WORKER_CHECK(all == before, what + ": changed the root's send buffer");
}

// Every root, dtype, op and algorithm; counts 0, 1, odd, on both sides of
// the shared-memory staging limit (DDP_TEST_CHUNK_BYTES=256 makes it 4 KiB)
// and over several chunks; then async calls queued behind each other.
int ScenarioSweep() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  const std::vector<size_t> counts = {0, 1, 7, 1001, 6000};
  for (int root = 0; root < n; ++root) {
    for (Algorithm algorithm : {Algorithm::kAuto, Algorithm::kTree, Algorithm::kRing}) {
      for (DataType dtype : kAllDataTypes) {
        for (ReduceOp op : kOps) {
          for (size_t count : counts) {
            CheckReduce(*comm, root, count, dtype, op, (count + root) % 2 == 1, algorithm);
          }
        }
      }
    }
    for (DataType dtype : kAllDataTypes) {
      for (size_t count : counts) {
        CheckGather(*comm, root, count, dtype, (count + root) % 2 == 0, count == 7);
        CheckScatter(*comm, root, count, dtype, (count + root) % 2 == 1, count == 1001);
      }
    }
  }
  // Async rooted calls interleaved with an all-reduce run in issue order;
  // a blocking call after them finds them done.
  const size_t count = 3000;
  std::vector<float> send(count), reduced(count, -1.0f), all(n * count), part(count, -1.0f);
  FillInput(DataType::kF32, send.data(), count, me, ReduceOp::kSum);
  std::vector<float> summed = send;
  const int root = n - 1;
  Work reduce = comm->ReduceAsync(send.data(), reduced.data(), count, DataType::kF32,
                                  ReduceOp::kSum, root);
  Work sum = comm->AllReduceAsync(summed.data(), summed.data(), count, DataType::kF32,
                                  ReduceOp::kSum);
  Work gather = comm->GatherAsync(send.data(), all.data(), count, DataType::kF32, 0);
  Work scatter = comm->ScatterAsync(all.data(), part.data(), count, DataType::kF32, 0);
  WORKER_CHECK(comm->Barrier().ok(), "barrier after async");
  for (Work* w : {&reduce, &sum, &gather, &scatter}) {
    auto done = w->Test();
    WORKER_CHECK(done.ok() && *done, "async call not done before a later blocking call");
  }
  if (me == root) {
    WORKER_CHECK(CountWrong(DataType::kF32, reduced.data(), count, n, ReduceOp::kSum) == 0,
                 "async reduce");
  }
  WORKER_CHECK(CountWrong(DataType::kF32, summed.data(), count, n, ReduceOp::kSum) == 0,
               "async all-reduce");
  // The scatter sent rank q the gathered block q: its own input.
  WORKER_CHECK(part == send, "async gather then scatter");
  if (me == 0) {
    std::printf("INFO shm=%d tls=%s\n", comm->info().shared_memory, comm->info().ucx_tls.c_str());
  }
  return testing::worker_failures == 0 ? 0 : 1;
}

// Arguments that every rank passes alike, refused before anything moves
// (the same refusal on every rank): INVALID_ARGUMENT naming the value, and
// the communicator still works.
int ScenarioLocalErrors() {
  auto comm = MustCreate();
  const int n = comm->size();
  std::vector<float> a(4 * n, 1.0f), b(4 * n, 0.0f);
  auto expect = [&](const Status& s, StatusCode code, const std::string& text) {
    WORKER_CHECK(s.code() == code && s.message().find(text) != std::string::npos,
                 "expected " + std::string(StatusCodeName(code)) + " with \"" + text + "\", got " +
                     s.ToString());
  };
  const std::string outside = " is outside a world of size " + std::to_string(n);
  for (int root : {n, -1}) {
    const std::string r = std::to_string(root);
    expect(comm->Reduce(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, root),
           StatusCode::kInvalidArgument, "reduce root " + r + outside);
    expect(comm->Gather(a.data(), b.data(), 4, DataType::kF32, root),
           StatusCode::kInvalidArgument, "gather root " + r + outside);
    expect(comm->Scatter(a.data(), b.data(), 4, DataType::kF32, root),
           StatusCode::kInvalidArgument, "scatter root " + r + outside);
    expect(comm->ReduceAsync(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, root).Wait(),
           StatusCode::kInvalidArgument, "reduce root " + r + outside);
    expect(comm->GatherAsync(a.data(), b.data(), 4, DataType::kF32, root).Wait(),
           StatusCode::kInvalidArgument, "gather root " + r + outside);
    expect(comm->ScatterAsync(a.data(), b.data(), 4, DataType::kF32, root).Wait(),
           StatusCode::kInvalidArgument, "scatter root " + r + outside);
    expect(comm->Broadcast(a.data(), 4, DataType::kF32, root), StatusCode::kInvalidArgument,
           "broadcast root " + r + outside);
  }
  // Unknown enum values name the call and list the valid values.
  const std::string dtypes = " (valid: 0 f32, 1 f64, 2 f16, 3 bf16, 4 i32, 5 i64, 6 u8)";
  const std::string ops = " (valid: 0 sum, 1 avg, 2 max, 3 min, 4 prod)";
  expect(comm->Reduce(a.data(), b.data(), 4, static_cast<DataType>(99), ReduceOp::kSum, 0),
         StatusCode::kInvalidArgument, "reduce: unknown dtype 99" + dtypes);
  expect(comm->Reduce(a.data(), b.data(), 4, DataType::kF32, static_cast<ReduceOp>(42), 0),
         StatusCode::kInvalidArgument, "reduce: unknown reduce op 42" + ops);
  expect(comm->AllReduceAsync(a.data(), b.data(), 4, DataType::kF32, static_cast<ReduceOp>(42)).Wait(),
         StatusCode::kInvalidArgument, "all-reduce: unknown reduce op 42" + ops);
  expect(comm->Send(a.data(), 4, static_cast<DataType>(-1), 0, 7), StatusCode::kInvalidArgument,
         "send: unknown dtype -1" + dtypes);
  expect(comm->Reduce(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, 0,
                      {.algorithm = Algorithm::kRhd}),
         StatusCode::kInvalidArgument, "reduce: algorithm rhd is not auto, tree, ring or shm");
  expect(comm->Gather(a.data(), b.data(), SIZE_MAX / 2, DataType::kF32, 0),
         StatusCode::kInvalidArgument, "overflows");
  // An all-reduce algorithm past the named ones is refused like an unknown
  // op, before anything moves: it used to reach the algorithm table, fail
  // the call there and abort the communicator on every rank.
  const Algorithm bogus = static_cast<Algorithm>(9);
  expect(comm->AllReduce(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, {.algorithm = bogus}),
         StatusCode::kInvalidArgument, "all-reduce: unknown algorithm 9");
  expect(comm->AllReduceAsync(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, {.algorithm = bogus})
             .Wait(),
         StatusCode::kInvalidArgument, "all-reduce: unknown algorithm 9");
  {
    // The communicator's own: creation refuses it before reaching a store
    // (none listens on port 1).
    CommunicatorOptions bad;
    bad.store_port = 1;
    bad.host_store = false;
    bad.timeout = milliseconds(500);
    bad.algorithm = bogus;
    auto made = Communicator::Create(bad);
    expect(made.status(), StatusCode::kInvalidArgument, "options: unknown algorithm 9");
  }
  // Point-to-point calls check the count too: its bytes wrapped to 4 and a
  // 4-byte message was sent (or awaited) as if the call had been whole.
  const size_t wraps = SIZE_MAX / 4 + 2;
  const std::string wrapped = std::to_string(wraps) + " elements of f32 overflow the address space";
  const int next = (comm->rank() + 1) % n, prev = (comm->rank() + n - 1) % n;
  expect(comm->Send(a.data(), wraps, DataType::kF32, next, 9), StatusCode::kInvalidArgument, "send: " + wrapped);
  expect(comm->SendAsync(a.data(), wraps, DataType::kF32, next, 9).Wait(), StatusCode::kInvalidArgument,
         "send: " + wrapped);
  expect(comm->Recv(b.data(), wraps, DataType::kF32, prev, 9, {.timeout = std::chrono::milliseconds(2000)}),
         StatusCode::kInvalidArgument, "receive: " + wrapped);
  expect(comm->RecvAsync(b.data(), wraps, DataType::kF32, prev, 9, {.timeout = std::chrono::milliseconds(2000)})
             .Wait(),
         StatusCode::kInvalidArgument, "receive: " + wrapped);
  // Null buffers with such a count: the count is refused first, on every
  // rank alike, not the buffers.
  expect(comm->AllGather(nullptr, nullptr, SIZE_MAX / 2, DataType::kF32),
         StatusCode::kInvalidArgument, "overflow the address space");
  // CallOptions every call checks alike: an algorithm forced on a call that
  // has none to choose, or a value past either enum. They used to be
  // dropped unseen (the call ran as kAuto). Each row would run on the old
  // code, the same on every rank, so nothing waits for a refused peer.
  const StagedReduce bad_staged = static_cast<StagedReduce>(7);
  const std::string none_to_choose =
      ": CallOptions::algorithm is ring, but only all-reduce, all-reduce-through and reduce choose an algorithm";
  const CallOptions ring{.algorithm = Algorithm::kRing};
  const CallOptions bogus_staged{.staged_reduce = bad_staged};
  expect(comm->Broadcast(a.data(), 4, DataType::kF32, 0, ring), StatusCode::kInvalidArgument,
         "broadcast" + none_to_choose);
  expect(comm->BroadcastAsync(a.data(), 4, DataType::kF32, 0, bogus_staged).Wait(),
         StatusCode::kInvalidArgument, "broadcast: unknown staged_reduce 7");
  expect(comm->AllGather(a.data(), b.data(), 4, DataType::kF32, {.algorithm = bogus}),
         StatusCode::kInvalidArgument, "all-gather: unknown algorithm 9");
  expect(comm->AllGatherAsync(a.data(), b.data(), 4, DataType::kF32, ring).Wait(),
         StatusCode::kInvalidArgument, "all-gather" + none_to_choose);
  expect(comm->ReduceScatter(a.data(), b.data(), 1, DataType::kF32, ReduceOp::kSum, ring),
         StatusCode::kInvalidArgument, "reduce-scatter" + none_to_choose);
  expect(comm->ReduceScatterAsync(a.data(), b.data(), 1, DataType::kF32, ReduceOp::kSum, {.algorithm = bogus})
             .Wait(),
         StatusCode::kInvalidArgument, "reduce-scatter: unknown algorithm 9");
  expect(comm->ReduceScatter(a.data(), b.data(), 1, DataType::kF32, ReduceOp::kSum, bogus_staged),
         StatusCode::kInvalidArgument, "reduce-scatter: unknown staged_reduce 7");
  expect(comm->AllToAll(a.data(), b.data(), 4, DataType::kF32, ring), StatusCode::kInvalidArgument,
         "all-to-all" + none_to_choose);
  expect(comm->AllToAllAsync(a.data(), b.data(), 4, DataType::kF32, bogus_staged).Wait(),
         StatusCode::kInvalidArgument, "all-to-all: unknown staged_reduce 7");
  expect(comm->Gather(a.data(), b.data(), 4, DataType::kF32, 0, ring), StatusCode::kInvalidArgument,
         "gather" + none_to_choose);
  expect(comm->ScatterAsync(a.data(), b.data(), 4, DataType::kF32, 0, {.algorithm = bogus}).Wait(),
         StatusCode::kInvalidArgument, "scatter: unknown algorithm 9");
  expect(comm->Reduce(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, 0, bogus_staged),
         StatusCode::kInvalidArgument, "reduce: unknown staged_reduce 7");
  expect(comm->AllReduce(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum, bogus_staged),
         StatusCode::kInvalidArgument, "all-reduce: unknown staged_reduce 7");
  expect(comm->AllReduceThrough(a.data(), b.data(), 4, DataType::kF32, ReduceOp::kSum,
                                [](const void*, void*, size_t, size_t) { return Status::Ok(); },
                                bogus_staged),
         StatusCode::kInvalidArgument, "all-reduce-through: unknown staged_reduce 7");
  expect(comm->Barrier(ring), StatusCode::kInvalidArgument, "barrier" + none_to_choose);
  expect(comm->BarrierAsync(bogus_staged).Wait(), StatusCode::kInvalidArgument,
         "barrier: unknown staged_reduce 7");
  expect(comm->Split(0, comm->rank(), ring).status(), StatusCode::kInvalidArgument, "split" + none_to_choose);
  {
    // The receive first, so that the send has its match on the old code.
    Work recv = comm->RecvAsync(b.data(), 4, DataType::kF32, prev, 10,
                                {.timeout = std::chrono::milliseconds(2000), .staged_reduce = bad_staged});
    expect(comm->Send(a.data(), 4, DataType::kF32, next, 10,
                      {.timeout = std::chrono::milliseconds(2000), .algorithm = Algorithm::kRing}),
           StatusCode::kInvalidArgument, "send" + none_to_choose);
    expect(recv.Wait(DeadlineIn(std::chrono::milliseconds(3000))), StatusCode::kInvalidArgument,
           "receive: unknown staged_reduce 7");
  }
  // Still usable: a real reduce and gather.
  std::vector<float> x(8), y(8 * n);
  FillInput(DataType::kF32, x.data(), x.size(), comm->rank(), ReduceOp::kSum);
  Status s = comm->Reduce(x.data(), y.data(), x.size(), DataType::kF32, ReduceOp::kSum, 0);
  WORKER_CHECK(s.ok(), "reduce after refused calls: " + s.ToString());
  if (comm->rank() == 0) {
    WORKER_CHECK(CountWrong(DataType::kF32, y.data(), x.size(), n, ReduceOp::kSum) == 0,
                 "reduce after refused calls");
  }
  WORKER_CHECK(comm->Gather(x.data(), y.data(), x.size(), DataType::kF32, n - 1).ok(),
               "gather after refused calls");
  WORKER_CHECK(comm->aborted_reason().ok(), "aborted: " + comm->aborted_reason().ToString());
  return testing::worker_failures == 0 ? 0 : 1;
}

// Buffers refused on some ranks only (each rank's own: null, overlapping,
// misaligned), each case on a communicator of its own split off the job's:
// the refusing rank gets INVALID_ARGUMENT naming itself and the buffer, and
// aborts the communicator; every other rank fails the call, or at the
// latest the barrier after it, with that reason, within seconds.
int ScenarioRefusalTexts() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  std::vector<float> a(4 * n, 1.0f), b(4 * n, 0.0f);
  float* af = a.data();
  float* bf = b.data();
  char* ab = reinterpret_cast<char*>(a.data());
  struct Case {
    bool root_only;  // refused on rank 0 (the root) only, else on every rank
    std::string text;
    std::function<Status(Communicator&, bool refuse)> call;
  };
  const std::vector<Case> cases = {
      {false, "reduce send buffer is null with count 4",
       [&](Communicator& c, bool) { return c.Reduce(nullptr, bf, 4, DataType::kF32, ReduceOp::kSum, 0); }},
      {true, "reduce receive buffer is null",
       [&](Communicator& c, bool refuse) {
         return c.Reduce(af, refuse ? nullptr : bf, 4, DataType::kF32, ReduceOp::kSum, 0);
       }},
      {true, "overlap other than in place (send == recv)",
       [&](Communicator& c, bool refuse) {
         return c.Reduce(af, refuse ? af + 1 : bf, 4, DataType::kF32, ReduceOp::kSum, 0);
       }},
      {true, "(send == recv + root * count)",
       [&](Communicator& c, bool refuse) {
         return c.Gather(refuse ? af + 1 : af, refuse ? af : bf, 4, DataType::kF32, 0);
       }},
      {true, "scatter send buffer is null with count " + std::to_string(4 * n),
       [&](Communicator& c, bool refuse) { return c.Scatter(refuse ? nullptr : af, bf, 4, DataType::kF32, 0); }},
      {true, "gather receive buffer is null",
       [&](Communicator& c, bool refuse) {
         return c.GatherAsync(af, refuse ? nullptr : bf, 4, DataType::kF32, 0).Wait();
       }},
      {false, "all-reduce: the send and receive buffers overlap other than in place (send == recv)",
       [&](Communicator& c, bool) { return c.AllReduce(af, af + 1, 4, DataType::kF32, ReduceOp::kSum); }},
      {false, "all-reduce: the send and receive buffers overlap",
       [&](Communicator& c, bool) {
         return c.AllReduceAsync(af + 1, af, 4, DataType::kF32, ReduceOp::kSum).Wait();
       }},
      {false, "all-gather: the send and receive buffers overlap other than in place (send == recv + rank * count)",
       [&](Communicator& c, bool) { return c.AllGather(af + 1, af, 4, DataType::kF32); }},
      {false, "reduce-scatter: the send and receive buffers overlap other than in place (recv == send + rank * count)",
       [&](Communicator& c, bool) { return c.ReduceScatter(af, af + 1, 4, DataType::kF32, ReduceOp::kSum); }},
      {false, "all-reduce: the send buffer is not aligned to the 4-byte size of f32",
       [&](Communicator& c, bool) { return c.AllReduce(ab + 1, bf, 2, DataType::kF32, ReduceOp::kSum); }},
      {false, "broadcast: the buffer is not aligned to the 4-byte size of f32",
       [&](Communicator& c, bool) { return c.Broadcast(reinterpret_cast<char*>(bf) + 2, 2, DataType::kF32, 0); }},
      {true, "reduce: the receive buffer is not aligned to the 4-byte size of f32",
       [&](Communicator& c, bool refuse) {
         return c.Reduce(af, refuse ? static_cast<void*>(reinterpret_cast<char*>(bf) + 1) : bf, 2, DataType::kF32,
                         ReduceOp::kSum, 0);
       }},
      {false, "reduce: the send buffer is not aligned to the 4-byte size of f32",
       [&](Communicator& c, bool) { return c.Reduce(ab + 2, bf, 2, DataType::kF32, ReduceOp::kSum, 0); }},
  };
  for (const Case& c : cases) {
    auto child = comm->Split(0, me);
    WORKER_CHECK(child.ok() && *child != nullptr, "split: " + child.status().ToString());
    if (!child.ok() || *child == nullptr) return 1;
    Communicator& sub = **child;
    const bool refuse = !c.root_only || me == 0;
    const auto start = Clock::now();
    const Status called = c.call(sub, refuse);
    const Status next = sub.Barrier();
    const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    const Status& first = called.ok() ? next : called;
    const std::string what = c.text + (refuse ? " (refused here)" : " (refused on rank 0)");
    WORKER_CHECK(!next.ok(), what + ": the barrier after the refusal passed");
    WORKER_CHECK(first.message().find(c.text) != std::string::npos,
                 what + ": rank " + std::to_string(me) + " got " + first.ToString());
    WORKER_CHECK(first.message().find(" refused the call: ") != std::string::npos,
                 what + ": rank " + std::to_string(me) + " got " + first.ToString());
    if (refuse) {
      WORKER_CHECK(called.code() == StatusCode::kInvalidArgument, what + ": " + called.ToString());
    }
    WORKER_CHECK(ms < 10000, what + ": took " + std::to_string(ms) + " ms");
    WORKER_CHECK(!sub.aborted_reason().ok(), what + ": the communicator was not aborted");
  }
  // The job's own communicator was never involved.
  WORKER_CHECK(comm->Barrier().ok(), "barrier on the parent");
  return testing::worker_failures == 0 ? 0 : 1;
}

// DDP_TEST_REFUSAL names a call that rank DDP_TEST_REFUSING_RANK refuses
// for its own buffers (or count list) while the others pass good ones;
// every rank then runs a barrier, and prints how each ended and when.
int ScenarioRefused() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  const std::string refusal = EnvOr("DDP_TEST_REFUSAL");
  const int refusing = std::atoi(EnvOr("DDP_TEST_REFUSING_RANK", "0").c_str());
  const bool refuse = me == refusing;
  if (const Status ready = comm->Barrier(); !ready.ok()) {
    // The refusing rank may leave the barrier, refuse and abort the job
    // while this rank still finishes its last barrier step (a loaded
    // machine): then the barrier reports the refusal, as the call would.
    if (refuse || ready.code() != StatusCode::kInvalidArgument) return 2;
    std::printf("RESULT %s ms=0\nNEXT %s ms=0\n", ready.ToString().c_str(), ready.ToString().c_str());
    return 0;
  }
  const Algorithm algorithm = static_cast<Algorithm>(std::atoi(EnvOr("DDP_TEST_ALGO", "0").c_str()));
  std::vector<float> send(4 * n, 1.0f), recv(4 * n, 0.0f);
  const auto start = Clock::now();
  auto since = [&] {
    return static_cast<long long>(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count());
  };
  Status s;
  if (refusal == "reduce_null_recv" || refusal == "reduce_null_recv_async") {
    // The root (the refusing rank) passes a null recv; the others' recv is
    // ignored anyway.
    void* out = refuse ? nullptr : recv.data();
    s = refusal == "reduce_null_recv"
            ? comm->Reduce(send.data(), out, 4, DataType::kF32, ReduceOp::kSum, refusing,
                           {.algorithm = algorithm})
            : comm->ReduceAsync(send.data(), out, 4, DataType::kF32, ReduceOp::kSum, refusing,
                                {.algorithm = algorithm})
                  .Wait();
  } else if (refusal == "allreduce_misaligned") {
    const void* in = refuse ? static_cast<const void*>(reinterpret_cast<char*>(send.data()) + 1)
                            : send.data();
    s = comm->AllReduce(in, recv.data(), 2, DataType::kF32, ReduceOp::kSum, {.algorithm = algorithm});
  } else if (refusal == "alltoallv_counts") {
    std::vector<size_t> counts(static_cast<size_t>(n), 1);
    std::vector<size_t> sends = counts;
    if (refuse) sends.pop_back();
    s = comm->AllToAllV(send.data(), sends, recv.data(), counts, DataType::kF32);
  } else {
    std::fprintf(stderr, "unknown refusal %s\n", refusal.c_str());
    return 2;
  }
  std::printf("RESULT %s ms=%lld\n", s.ToString().c_str(), since());
  const Status next = comm->Barrier();
  std::printf("NEXT %s ms=%lld\n", next.ToString().c_str(), since());
  return 0;
}

// DDP_TEST_DISAGREE=count|root on rank 1, for DDP_TEST_COLLECTIVE (reduce,
// gather, scatter, or alltoallv, which knows count only); every
// rank prints how its call ended and how long it took.
int ScenarioDisagree() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  // Every rank connected before two of them can fail the job (a rank still
  // connecting to a peer that left fails its creation instead).
  if (const Status ready = comm->Barrier(); !ready.ok()) {
    // A faster pair of ranks found the disagreement and aborted the job
    // while this rank still finished its last barrier step.
    if (ready.code() != StatusCode::kInvalidArgument) return 2;
    std::printf("RESULT %s ms=0\nNEXT %s\n", ready.ToString().c_str(), ready.ToString().c_str());
    return 0;
  }
  const std::string disagree = EnvOr("DDP_TEST_DISAGREE");
  const std::string collective = EnvOr("DDP_TEST_COLLECTIVE");
  size_t count = 5000;
  int root = 0;
  Algorithm algorithm = static_cast<Algorithm>(std::atoi(EnvOr("DDP_TEST_ALGO", "0").c_str()));
  if (me == 1 && disagree == "count") count = 4000;
  if (me == 1 && disagree == "root") root = 2;
  // Past the tree's 256 KiB over UCX: the ring reduce for the default choice.
  if (me == 1 && disagree == "size") count = 70000;
  if (me == 1 && disagree == "algorithm") algorithm = Algorithm::kRing;
  std::vector<float> send(std::max(n * 5000, 70000), 1.0f), recv(send.size());
  const auto start = Clock::now();
  Status s;
  if (collective == "reduce") {
    s = comm->Reduce(send.data(), recv.data(), count, DataType::kF32, ReduceOp::kSum, root,
                     {.algorithm = algorithm});
  } else if (collective == "gather") {
    s = comm->Gather(send.data(), recv.data(), count, DataType::kF32, root);
  } else if (collective == "alltoallv") {
    // 100 elements to every rank; with "count", rank 1 sends rank 0 99.
    std::vector<size_t> sends(n, 100), receives(n, 100);
    if (me == 1 && disagree == "count") sends[0] = 99;
    s = comm->AllToAllV(send.data(), sends, recv.data(), receives, DataType::kF32);
  } else {
    s = comm->Scatter(send.data(), recv.data(), count, DataType::kF32, root);
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  std::printf("RESULT %s ms=%lld\n", s.ToString().c_str(), static_cast<long long>(ms));
  // Whatever this rank saw, the job is aborted for everyone afterwards.
  Status next = comm->Barrier();
  std::printf("NEXT %s\n", next.ToString().c_str());
  return 0;
}

// Rank DDP_TEST_GONE_RANK leaves (DDP_TEST_GONE=exit: dies before the call;
// sleep: waits until every other rank's call has ended, DDP_TEST_LATE_MS at
// most, past the others' deadline, and exits without the call); the others
// run a rooted call and print how it ended.
int ScenarioGone() {
  auto comm = MustCreate();
  const int n = comm->size(), me = comm->rank();
  const int gone = std::atoi(EnvOr("DDP_TEST_GONE_RANK", "1").c_str());
  const std::string how = EnvOr("DDP_TEST_GONE");
  const Status ready = comm->Barrier();
  if (!ready.ok()) {
    // The gone rank exits as soon as its own barrier returned, when another
    // rank may still wait in its last barrier step: that rank then sees the
    // loss there, which is the outcome the call below would have had.
    if (me != gone && how == "exit" && ready.code() == StatusCode::kPeerLost) {
      std::printf("RESULT %s ms=0\n", ready.ToString().c_str());
      return 0;
    }
    return 2;
  }
  if (me == gone) {
    if (how == "exit") _exit(7);
    const auto until = Clock::now() + milliseconds(std::atoi(EnvOr("DDP_TEST_LATE_MS").c_str()));
    // Not a check: a rank that waited for this one reports it.
    for (int r = 0; r < n; ++r) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now());
      if (r != me) testing::AwaitMark("call_ended_" + std::to_string(r), std::max(left, milliseconds(0)));
    }
    return 0;
  }
  std::vector<float> send(n * 100000, 1.0f), recv(n * 100000);
  const std::string collective = EnvOr("DDP_TEST_COLLECTIVE");
  const auto start = Clock::now();
  Status s;
  if (collective == "reduce") {
    s = comm->Reduce(send.data(), recv.data(), 100000, DataType::kF32, ReduceOp::kSum, 0);
  } else if (collective == "gather") {
    s = comm->Gather(send.data(), recv.data(), 100000, DataType::kF32, 0);
  } else {
    s = comm->Scatter(send.data(), recv.data(), 100000, DataType::kF32, 0);
  }
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  std::printf("RESULT %s ms=%lld\n", s.ToString().c_str(), static_cast<long long>(ms));
  std::fflush(stdout);
  testing::SetMark("call_ended_" + std::to_string(me));
  return s.ok() ? 1 : 0;
}

int RunScenario(const std::string& name) {
  if (name == "sweep") return ScenarioSweep();
  if (name == "local_errors") return ScenarioLocalErrors();
  if (name == "refusal_texts") return ScenarioRefusalTexts();
  if (name == "refused") return ScenarioRefused();
  if (name == "disagree") return ScenarioDisagree();
  if (name == "gone") return ScenarioGone();
  std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
  return 2;
}

// ------------------------------------------------------------- parent ----

// The "ms=" a worker printed after RESULT.
int ResultMs(const std::string& output) {
  const size_t at = output.find("ms=");
  return at == std::string::npos ? -1 : std::atoi(output.c_str() + at + 3);
}

struct SweepParam {
  int ranks;
  bool shared_memory;
};

class Sweep : public ::testing::TestWithParam<SweepParam> {};

TEST_P(Sweep, EveryRootDtypeOpAlgorithmAndSize) {
  const SweepParam p = GetParam();
  Job job = RunJob(p.ranks, "sweep",
                   {{"DDP_TEST_CHUNK_BYTES", "256"},
                    {"DDP_SHARED_MEMORY", p.shared_memory ? "1" : "0"}});
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
  const bool shm = p.shared_memory && p.ranks > 1;
  EXPECT_NE(job.results[0].output.find(shm ? "shm=1" : "shm=0"), std::string::npos)
      << job.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, Sweep,
                         ::testing::Values(SweepParam{1, true}, SweepParam{2, true},
                                           SweepParam{3, true}, SweepParam{4, true},
                                           SweepParam{2, false}, SweepParam{3, false},
                                           SweepParam{4, false}),
                         [](const auto& info) {
                           return std::to_string(info.param.ranks) + "ranks" +
                                  (info.param.shared_memory ? "Shm" : "Ucx");
                         });

TEST(RootedCollectives, ArgumentErrorsOfEveryRankAreNamedAndLeaveTheCommunicatorUsable) {
  Job job = RunJob(3, "local_errors", {{"DDP_TEST_TIMEOUT_MS", "10000"}});
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

TEST(RootedCollectives, BufferRefusalsAreNamedAndAbortTheCommunicator) {
  Job job = RunJob(3, "refusal_texts", {{"DDP_TEST_TIMEOUT_MS", "60000"}}, milliseconds(240000));
  for (const auto& r : job.results) ASSERT_EQ(r.exit_code, 0) << job.Describe();
}

// The text after `tag` ("RESULT ", "NEXT ") up to the end of its line.
std::string Line(const std::string& output, const std::string& tag) {
  const size_t at = output.find(tag);
  if (at == std::string::npos) return "";
  return output.substr(at, output.find('\n', at) - at);
}

// Rank `refusing` refuses a call for its own buffers (the others pass
// good ones): with a 60 s deadline, every rank fails within a few seconds,
// the call or (a rank whose part was done before it could tell: a
// leaf whose data went out) the barrier after it, with INVALID_ARGUMENT
// naming the refusing rank and the reason; no rank passes the barrier.
void ExpectRefusalFailsEverywhere(const std::string& refusal, int refusing, bool shared_memory,
                                  const std::string& reason, Algorithm algorithm = Algorithm::kAuto) {
  SCOPED_TRACE(refusal + " on rank " + std::to_string(refusing) + (shared_memory ? " shm" : " ucx"));
  Job job = RunJob(4, "refused",
                   {{"DDP_TEST_TIMEOUT_MS", "60000"},
                    {"DDP_TEST_REFUSAL", refusal},
                    {"DDP_TEST_REFUSING_RANK", std::to_string(refusing)},
                    {"DDP_TEST_ALGO", std::to_string(static_cast<int>(algorithm))},
                    {"DDP_SHARED_MEMORY", shared_memory ? "1" : "0"}},
                   milliseconds(120000));
  const std::string named = "rank " + std::to_string(refusing) + " refused the call: ";
  for (size_t r = 0; r < job.results.size(); ++r) {
    const std::string& out = job.results[r].output;
    ASSERT_EQ(job.results[r].exit_code, 0) << job.Describe();
    const std::string result = Line(out, "RESULT "), next = Line(out, "NEXT ");
    ASSERT_NE(next, "") << job.Describe();
    EXPECT_EQ(next.find("NEXT OK"), std::string::npos) << job.Describe();
    EXPECT_LT(ResultMs(next), 10000) << job.Describe();
    const std::string& first = result.find("RESULT OK") == std::string::npos ? result : next;
    EXPECT_NE(first.find("INVALID_ARGUMENT"), std::string::npos) << "rank " << r << "\n" << job.Describe();
    EXPECT_NE(first.find(named + reason), std::string::npos) << "rank " << r << "\n" << job.Describe();
    if (static_cast<int>(r) == refusing) {
      EXPECT_EQ(result.find("RESULT OK"), std::string::npos) << job.Describe();
      EXPECT_LT(ResultMs(result), 5000) << job.Describe();
    }
  }
}

TEST(RootedCollectives, RootOnlyRefusalFailsEveryRankSharedMemory) {
  ExpectRefusalFailsEverywhere("reduce_null_recv", 0, true, "reduce receive buffer is null with count 4");
  ExpectRefusalFailsEverywhere("reduce_null_recv_async", 2, true, "reduce receive buffer is null with count 4");
}
TEST(RootedCollectives, RootOnlyRefusalFailsEveryRankUcx) {
  ExpectRefusalFailsEverywhere("reduce_null_recv", 0, false, "reduce receive buffer is null with count 4",
                               Algorithm::kTree);
  ExpectRefusalFailsEverywhere("reduce_null_recv_async", 2, false,
                               "reduce receive buffer is null with count 4", Algorithm::kRing);
}
TEST(RootedCollectives, OneRanksRefusalOfAnUnrootedCallFailsEveryRank) {
  ExpectRefusalFailsEverywhere("allreduce_misaligned", 1, true,
                               "all-reduce: the send buffer is not aligned to the 4-byte size of f32");
  ExpectRefusalFailsEverywhere("allreduce_misaligned", 3, false,
                               "all-reduce: the send buffer is not aligned", Algorithm::kRing);
  ExpectRefusalFailsEverywhere("alltoallv_counts", 1, false, "all-to-all: 3 send counts and 4 receive counts");
}

// Rank 1 passes another count or root: well before the 10 s deadline, a
// rank finds it (INVALID_ARGUMENT naming both values) and every rank fails
// the call, with that or the job's abort reason, except, in shared memory,
// a rank other than the root that agreed with the root in a staged reduce
// or gather or in a scatter: it waits for the root alone and may take its
// part and return OK before the root's failure reaches it. That one fails
// its next call. (Over UCX the tree reduce, gather and scatter fail every
// rank's call with the disagreement itself.)
void ExpectDisagreementFailsEverywhere(const std::string& collective, const std::string& what,
                                       bool shared_memory, Algorithm algorithm = Algorithm::kAuto,
                                       int ranks = 3, const std::string& topology_file = "") {
  SCOPED_TRACE(collective + " " + what + (shared_memory ? " shm" : " ucx"));
  Job job = RunJob(ranks, "disagree",
                   {{"DDP_TEST_TIMEOUT_MS", "10000"},
                    {"DDP_TEST_DISAGREE", what},
                    {"DDP_TEST_COLLECTIVE", collective},
                    {"DDP_TEST_ALGO", std::to_string(static_cast<int>(algorithm))},
                    {"DDP_SHARED_MEMORY", shared_memory ? "1" : "0"},
                    {"DDP_TOPOLOGY_FILE", topology_file}},
                   milliseconds(30000));
  int named = 0, call_failed = 0;
  for (const auto& r : job.results) {
    ASSERT_EQ(r.exit_code, 0) << job.Describe();
    EXPECT_LT(ResultMs(r.output), 5000) << job.Describe();
    EXPECT_EQ(r.output.find("NEXT OK"), std::string::npos) << job.Describe();
    named += r.output.find("disagree") != std::string::npos ||
             r.output.find("differ across ranks") != std::string::npos;
    call_failed += r.output.find("RESULT OK") == std::string::npos;
  }
  EXPECT_GT(named, 0) << job.Describe();
  EXPECT_GE(call_failed, 2) << job.Describe();
}

TEST(RootedCollectives, DisagreeingCountFailsEverywhereSharedMemory) {
  for (const char* c : {"reduce", "gather", "scatter"}) ExpectDisagreementFailsEverywhere(c, "count", true);
}
TEST(RootedCollectives, DisagreeingRootFailsEverywhereSharedMemory) {
  for (const char* c : {"reduce", "gather", "scatter"}) ExpectDisagreementFailsEverywhere(c, "root", true);
}
TEST(RootedCollectives, DisagreeingCountFailsEverywhereUcx) {
  ExpectDisagreementFailsEverywhere("reduce", "count", false, Algorithm::kTree);
  ExpectDisagreementFailsEverywhere("reduce", "count", false, Algorithm::kRing);
  ExpectDisagreementFailsEverywhere("gather", "count", false);
  ExpectDisagreementFailsEverywhere("scatter", "count", false);
}
TEST(RootedCollectives, DisagreeingRootFailsEverywhereUcx) {
  ExpectDisagreementFailsEverywhere("reduce", "root", false, Algorithm::kTree);
  ExpectDisagreementFailsEverywhere("reduce", "root", false, Algorithm::kRing);
  ExpectDisagreementFailsEverywhere("gather", "root", false);
  ExpectDisagreementFailsEverywhere("scatter", "root", false);
}

// All-to-all with a size per pair (over UCX, also with shared memory on):
// rank 1 sends rank 0 one element less than rank 0 expects. Both ranks of
// the pair fail the call, well before the deadline, naming both ranks and
// both sizes; the sender returned OK before (only the receiver's receive
// was the wrong size).
TEST(RootedCollectives, AllToAllVPairDisagreeingOnABlockSizeFailsBothOfItsRanks) {
  for (bool shared_memory : {true, false}) {
    SCOPED_TRACE(shared_memory ? "shm" : "ucx");
    Job job = RunJob(3, "disagree",
                     {{"DDP_TEST_TIMEOUT_MS", "10000"},
                      {"DDP_TEST_DISAGREE", "count"},
                      {"DDP_TEST_COLLECTIVE", "alltoallv"},
                      {"DDP_SHARED_MEMORY", shared_memory ? "1" : "0"}},
                     milliseconds(30000));
    for (int r : {0, 1}) {
      ASSERT_EQ(job.results[r].exit_code, 0) << job.Describe();
      const std::string result = Line(job.results[r].output, "RESULT ");
      EXPECT_NE(result.find("INVALID_ARGUMENT"), std::string::npos)
          << "rank " << r << "\n" << job.Describe();
      EXPECT_NE(result.find("rank 1 sends rank 0 396 bytes but rank 0 expects 400"),
                std::string::npos)
          << "rank " << r << "\n" << job.Describe();
      EXPECT_LT(ResultMs(result), 5000) << "rank " << r << "\n" << job.Describe();
    }
  }
}

// Rank 1 runs the ring reduce (forced, or chosen for a count past the
// tree's 256 KiB), the others the tree, in a ring order other than the
// ranks' (two described hosts: 0 2 1 3). Both check their ring
// predecessor's arguments in that order; with the tree's ring taken in rank
// order instead, nobody met rank 1's and every rank waited out the deadline.
TEST(RootedCollectives, OneRankRunningTheRingReduceAgainstTheTreeFailsEverywhereUcx) {
  const std::string path = ::testing::TempDir() + "/two_hosts.json";
  std::ofstream(path) << R"({"hosts": [{"name": "a"}, {"name": "b"}],
      "ranks": [{"host": 0}, {"host": 1}, {"host": 0}, {"host": 1}]})";
  ExpectDisagreementFailsEverywhere("reduce", "algorithm", false, Algorithm::kTree, 4, path);
  ExpectDisagreementFailsEverywhere("reduce", "size", false, Algorithm::kAuto, 4, path);
}

// How far past their deadline survivors of a late peer may report (as
// communicator_test's survivors of a stopped peer): a peer that is merely
// late is noticed only at the deadline, which a loaded machine may overrun.
constexpr int kLateSlackMs = 2500;

// A rank that exits before the call (PEER_LOST naming it, or TIMED_OUT) or
// arrives after the deadline (TIMED_OUT): the root (rank 0) reports within
// the 1.5 s deadline plus a margin, and so does rank 2, except in a
// shared-memory scatter, where it needs only the root and may get its
// block (the worker then returns 1: RESULT OK). The late rank leaves once
// the others' calls have ended, and otherwise twice the margin after the
// deadline, so that a survivor waiting for it fails.
void ExpectSurvivorsReport(const std::string& collective, const std::string& how,
                           bool shared_memory) {
  SCOPED_TRACE(collective + " " + how + (shared_memory ? " shm" : " ucx"));
  const int timeout_ms = 1500;
  const int slack_ms = how == "sleep" ? kLateSlackMs : 1000;
  Job job = RunJob(3, "gone",
                   {{"DDP_TEST_TIMEOUT_MS", std::to_string(timeout_ms)},
                    {"DDP_TEST_LATE_MS", std::to_string(timeout_ms + 2 * kLateSlackMs)},
                    {"DDP_TEST_GONE", how},
                    {"DDP_TEST_GONE_RANK", "1"},
                    {"DDP_TEST_COLLECTIVE", collective},
                    {"DDP_SHARED_MEMORY", shared_memory ? "1" : "0"}},
                   milliseconds(30000));
  for (int r : {0, 2}) {
    const std::string& out = job.results[r].output;
    if (r == 2 && shared_memory && collective == "scatter" &&
        out.find("RESULT OK") != std::string::npos) {
      continue;
    }
    ASSERT_EQ(job.results[r].exit_code, 0) << job.Describe();
    const bool lost = out.find("RESULT PEER_LOST") != std::string::npos;
    const bool timed = out.find("RESULT TIMED_OUT") != std::string::npos;
    EXPECT_TRUE(how == "exit" ? lost || timed : timed) << job.Describe();
    if (lost) {
      EXPECT_NE(out.find("rank 1"), std::string::npos) << job.Describe();
    }
    EXPECT_LE(ResultMs(out), timeout_ms + slack_ms) << job.Describe();
  }
}

TEST(RootedCollectives, DeadPeerFailsTheOthers) {
  for (bool shm : {true, false}) {
    ExpectSurvivorsReport("reduce", "exit", shm);
    ExpectSurvivorsReport("gather", "exit", shm);
    ExpectSurvivorsReport("scatter", "exit", shm);
  }
}

TEST(RootedCollectives, LatePeerTimesOutAtTheDeadline) {
  ExpectSurvivorsReport("reduce", "sleep", true);
  ExpectSurvivorsReport("scatter", "sleep", false);
}

}  // namespace
}  // namespace ddp::transport

int main(int argc, char** argv) {
  return ddp::transport::testing::WorkerOrTestsMain(argc, argv, ddp::transport::RunScenario);
}
