#include <cblas.h>
#include <ucp/api/ucp.h>
#include <glog/logging.h>
#include <zlib.h>
#include <hwloc.h>
#include <nlohmann/json.hpp>
#include <dnnl.hpp>
#include <gtest/gtest.h>
TEST(Deps, Link) {
  unsigned major, minor, release;
  ucp_get_version(&major, &minor, &release);
  EXPECT_EQ(major, 1u);
  float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1}, c[4] = {};
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 2, 1, a, 2, b, 2, 0, c, 2);
  EXPECT_EQ(c[3], 4);
  EXPECT_NE(zlibVersion(), nullptr);
  hwloc_topology_t t; hwloc_topology_init(&t); hwloc_topology_load(t); hwloc_topology_destroy(t);
  EXPECT_EQ(nlohmann::json::parse("{\"a\":1}")["a"], 1);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
}
