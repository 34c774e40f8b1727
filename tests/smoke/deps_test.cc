// Each third-party dependency links and does real work: a call whose result
// is checked, not only one that returns.
#include <cblas.h>
#include <ucp/api/ucp.h>
#include <benchmark/benchmark.h>
#include <glog/logging.h>
#include <zlib.h>
#include <hwloc.h>
#include <nlohmann/json.hpp>
#include <dnnl.hpp>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

// Collects the messages glog hands to sinks.
class CollectingSink : public google::LogSink {
 public:
  using google::LogSink::send;
  void send(google::LogSeverity, const char*, const char*, int, const google::LogMessageTime&,
            const char* message, size_t message_len) override {
    messages.emplace_back(message, message_len);
  }
  std::vector<std::string> messages;
};

// Records the runs the benchmark library reports.
class CollectingReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) iterations.push_back(r.iterations);
  }
  std::vector<benchmark::IterationCount> iterations;
};

}  // namespace

TEST(Deps, Link) {
  unsigned major, minor, release;
  ucp_get_version(&major, &minor, &release);
  EXPECT_EQ(major, 1u);
  float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1}, c[4] = {};
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 2, 1, a, 2, b, 2, 0, c, 2);
  EXPECT_EQ(c[3], 4);
  EXPECT_EQ(nlohmann::json::parse("{\"a\":1}")["a"], 1);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  EXPECT_EQ(eng.get_kind(), dnnl::engine::kind::cpu);
}

// zlib compresses a compressible buffer and gives the same bytes back.
TEST(Deps, ZlibRoundTrip) {
  std::string input;
  for (int i = 0; i < 1000; ++i) input += "deps_test " + std::to_string(i % 10) + "\n";
  std::vector<Bytef> packed(compressBound(input.size()));
  uLongf packed_size = packed.size();
  ASSERT_EQ(compress(packed.data(), &packed_size, reinterpret_cast<const Bytef*>(input.data()),
                     input.size()),
            Z_OK);
  EXPECT_LT(packed_size, input.size() / 4);  // repetitive text shrinks
  std::string output(input.size(), '\0');
  uLongf output_size = output.size();
  ASSERT_EQ(uncompress(reinterpret_cast<Bytef*>(output.data()), &output_size, packed.data(),
                       packed_size),
            Z_OK);
  EXPECT_EQ(output_size, input.size());
  EXPECT_EQ(output, input);
}

// hwloc loads this machine's topology: at least one core and one PU.
TEST(Deps, HwlocLoadsTheTopology) {
  hwloc_topology_t t;
  ASSERT_EQ(hwloc_topology_init(&t), 0);
  ASSERT_EQ(hwloc_topology_load(t), 0);
  EXPECT_GE(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_MACHINE), 1);
  EXPECT_GE(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE), 1);
  EXPECT_GE(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU), 1);
  hwloc_topology_destroy(t);
}

// glog delivers a LOG line to a registered sink.
TEST(Deps, GlogDeliversToASink) {
  CollectingSink sink;
  google::AddLogSink(&sink);
  LOG(INFO) << "deps_test glog " << 42;
  google::RemoveLogSink(&sink);
  ASSERT_EQ(sink.messages.size(), 1u);
  EXPECT_EQ(sink.messages[0], "deps_test glog 42");
}

// The benchmark library runs a registered benchmark the number of
// iterations asked for and reports it.
TEST(Deps, BenchmarkRunsARegisteredBenchmark) {
  int calls = 0;
  benchmark::RegisterBenchmark("deps_test_bm", [&calls](benchmark::State& state) {
    for (auto _ : state) benchmark::DoNotOptimize(++calls);
  })->Iterations(7);
  CollectingReporter reporter;
  EXPECT_EQ(benchmark::RunSpecifiedBenchmarks(&reporter), 1u);
  ASSERT_EQ(reporter.iterations.size(), 1u);
  EXPECT_EQ(reporter.iterations[0], 7);
  EXPECT_EQ(calls, 7);
}
