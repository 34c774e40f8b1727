// Throughput of the reduction kernels, in bytes of the result buffer per
// second (each element is read twice and written once, so memory traffic is
// three times the figure). Run with:
//   bazel run -c opt //transport/reduce:reduce_bench -- --benchmark_min_time=0.2
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "transport/reduce/reduce.h"
#include "transport/types.h"

namespace ddp::transport::reduce {
namespace {

void BM_Reduce(benchmark::State& state, DataType dtype, ReduceOp op, Isa isa,
               bool in_place) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / DataTypeSize(dtype);
  // Values 0x01 in every byte are ordinary finite numbers for every type.
  std::vector<unsigned char> a(bytes, 1), b(bytes, 1), d(bytes, 1);
  const ReduceFn fn = GetReduceFn(dtype, op, isa);
  for (auto _ : state) {
    if (in_place) {
      fn(a.data(), a.data(), b.data(), count);
    } else {
      fn(d.data(), a.data(), b.data(), count);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * count *
                          DataTypeSize(dtype));
  state.SetLabel(IsaName(isa));
}

void BM_Divide(benchmark::State& state, DataType dtype, Isa isa) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / DataTypeSize(dtype);
  std::vector<unsigned char> a(bytes, 0x41);
  for (auto _ : state) {
    // Fresh inputs each time: repeated division would drift into
    // subnormals, which are far slower and not what avg sees.
    state.PauseTiming();
    std::memset(a.data(), 0x41, bytes);
    state.ResumeTiming();
    DivideInPlace(dtype, a.data(), count, 3, isa);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * count *
                          DataTypeSize(dtype));
  state.SetLabel(IsaName(isa));
}

// 256 KiB stays in L2 (the chunk size of the pipelined algorithms); 16 MiB
// goes to memory.
void Sizes(benchmark::internal::Benchmark* b) { b->Arg(256 << 10)->Arg(16 << 20); }

void Register() {
  const DataType types[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                            DataType::kBF16, DataType::kI32, DataType::kI64, DataType::kU8};
  std::vector<Isa> isas = {Isa::kGeneric};
  if (DetectIsa() == Isa::kAvx2) isas.push_back(Isa::kAvx2);
  for (Isa isa : isas) {
    for (DataType dtype : types) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        for (bool in_place : {true, false}) {
          const std::string name = std::string("reduce/") + IsaName(isa) + "/" +
                                   DataTypeName(dtype) + "/" + ReduceOpName(op) +
                                   (in_place ? "/inplace" : "/outofplace");
          benchmark::RegisterBenchmark(name.c_str(), BM_Reduce, dtype, op, isa, in_place)
              ->Apply(Sizes);
        }
      }
    }
    for (DataType dtype : {DataType::kF32, DataType::kF16, DataType::kBF16}) {
      const std::string name =
          std::string("divide/") + IsaName(isa) + "/" + DataTypeName(dtype);
      benchmark::RegisterBenchmark(name.c_str(), BM_Divide, dtype, isa)->Apply(Sizes);
    }
  }
}

const bool registered = (Register(), true);

}  // namespace
}  // namespace ddp::transport::reduce
