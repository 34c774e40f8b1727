// Prints how long SafetensorsFile::Read and ReadInto take over a file of
// many small tensors (200,000 of 4 bytes by default: a per-tensor cost
// shows, the bytes themselves hardly count). Best of 5 runs of each, in
// CPU time of the process, user and system (robust against other
// processes on a shared machine; the page cache holds the file after the
// first run, so the reads do not wait on a disk).
//
//   bazel run -c opt //nn/io:safetensors_bench -- [tensors] [path]

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"

namespace ddp::nn::io {
namespace {

double ProcessCpuSeconds() {
  timespec ts;
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double BestSeconds(const std::function<void()>& run) {
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const double start = ProcessCpuSeconds();
    run();
    best = std::min(best, ProcessCpuSeconds() - start);
  }
  return best;
}

int Main(int argc, char** argv) {
  const size_t count = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 200000;
  const std::string path =
      argc > 2 ? argv[2] : "/tmp/safetensors_bench_" + std::to_string(::getpid()) + ".safetensors";
  std::vector<float> values(count);
  std::vector<TensorView> views(count);
  for (size_t i = 0; i < count; ++i) {
    values[i] = static_cast<float>(i);
    views[i] = TensorView{"layer." + std::to_string(i) + ".weight", StDtype::kF32, {1}, &values[i], 4};
  }
  WriteSafetensorsFile(path, views);
  // Every other float of a buffer, so that no two destinations touch (as
  // tensors allocated one by one do not).
  std::vector<float> into(2 * count);
  const auto place = [&](const SafetensorsFile& f) {
    std::vector<void*> where(f.tensors().size());
    for (size_t i = 0; i < where.size(); ++i) where[i] = &into[2 * i];
    return where;
  };
  const double read = BestSeconds([&] { (void)SafetensorsFile::Read(path); });
  const double read_into = BestSeconds([&] { (void)SafetensorsFile::ReadInto(path, place); });
  std::printf("%zu tensors of 4 bytes: Read %.3f s, ReadInto %.3f s (CPU)\n", count, read, read_into);
  ::unlink(path.c_str());
  return 0;
}

}  // namespace
}  // namespace ddp::nn::io

int main(int argc, char** argv) { return ddp::nn::io::Main(argc, argv); }
