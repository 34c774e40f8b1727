// Prints how long SafetensorsFile::Read and ReadInto take over two files:
// one of many small tensors (200,000 of 4 bytes by default: a per-tensor
// cost shows, the bytes themselves hardly count) and one of a few large
// ones (4 of 64 MiB by default: the bytes are all that counts). Best of 5
// runs of each, in CPU time of the process, user and system (robust
// against other processes on a shared machine; the page cache holds the
// files after the first run, so the reads do not wait on a disk), and the
// wall time of that same run.
//
//   bazel run //nn/io:safetensors_bench -- [small_count] [large_count] [large_mib]
//
// The files go to a fresh folder under $TMPDIR (or /tmp), removed at the end.

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"

namespace ddp::nn::io {
namespace {

double Seconds(clockid_t clock) {
  timespec ts;
  ::clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Timing {
  double cpu = 1e30;   // best CPU time of the process, user + system
  double wall = 1e30;  // wall time of that run
};

Timing Best(const std::function<void()>& run) {
  Timing best;
  for (int i = 0; i < 5; ++i) {
    const double cpu = Seconds(CLOCK_PROCESS_CPUTIME_ID), wall = Seconds(CLOCK_MONOTONIC);
    run();
    const double took = Seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    if (took < best.cpu) best = {took, Seconds(CLOCK_MONOTONIC) - wall};
  }
  return best;
}

// Writes `views` to `path`, times Read and ReadInto of it (each tensor to
// its own buffer of `into`, at `stride` bytes from the last, so that no two
// destinations touch, as tensors allocated one by one do not) and prints
// one line under `label`.
void Measure(const std::string& label, const std::string& path, const std::vector<TensorView>& views,
             size_t stride) {
  WriteSafetensorsFile(path, views);
  uint64_t total = 0;
  for (const TensorView& v : views) total += v.nbytes;
  std::vector<char> into(views.size() * stride);
  const auto place = [&](const SafetensorsFile& f) {
    std::vector<void*> where(f.tensors().size());
    for (size_t i = 0; i < where.size(); ++i) where[i] = into.data() + i * stride;
    return where;
  };
  const Timing read = Best([&] { (void)SafetensorsFile::Read(path); });
  const Timing read_into = Best([&] { (void)SafetensorsFile::ReadInto(path, place); });
  std::printf("%s (%.1f MiB of data): Read %.3f s CPU (%.3f s wall), ReadInto %.3f s CPU (%.3f s wall)\n",
              label.c_str(), static_cast<double>(total) / (1 << 20), read.cpu, read.wall, read_into.cpu,
              read_into.wall);
  ::unlink(path.c_str());
}

int Main(int argc, char** argv) {
  const size_t small_count = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 200000;
  const size_t large_count = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 4;
  const size_t large_mib = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 64;
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/safetensors_bench.XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "safetensors_bench: cannot make a folder from %s: %s\n", dir.c_str(), std::strerror(errno));
    return 1;
  }

  std::vector<float> values(small_count);
  std::vector<TensorView> views(small_count);
  for (size_t i = 0; i < small_count; ++i) {
    values[i] = static_cast<float>(i);
    views[i] = TensorView{"layer." + std::to_string(i) + ".weight", StDtype::kF32, {1}, &values[i], 4};
  }
  Measure(std::to_string(small_count) + " tensors of 4 bytes", dir + "/small.safetensors", views, 8);

  const size_t large_bytes = large_mib << 20;
  std::vector<char> large(large_count * large_bytes);
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<char>(i * 2654435761u >> 24);
  views.assign(large_count, TensorView{});
  for (size_t i = 0; i < large_count; ++i) {
    views[i] = TensorView{"block." + std::to_string(i) + ".weight", StDtype::kU8,
                          {static_cast<int64_t>(large_bytes)}, large.data() + i * large_bytes, large_bytes};
  }
  // 4 KiB between the destinations, so that they do not touch either.
  Measure(std::to_string(large_count) + " tensors of " + std::to_string(large_mib) + " MiB",
          dir + "/large.safetensors", views, large_bytes + 4096);
  ::rmdir(dir.c_str());
  return 0;
}

}  // namespace
}  // namespace ddp::nn::io

int main(int argc, char** argv) { return ddp::nn::io::Main(argc, argv); }
