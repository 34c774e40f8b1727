// Writes the seed corpora of the fuzz targets (small, valid or nearly valid
// inputs that reach every branch a fuzzer should start from) under the
// folder given as the only argument:
//   bazel run //tests/fuzz:make_seeds -- $PWD/tests/fuzz/corpus
// Regression inputs found by fuzzing are added beside them by hand (named
// crash-*) and are never overwritten by this tool.

#include <sys/stat.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"
#include "transport/store/wire.h"
#include "transport/topology/topology.h"

namespace {

namespace wire = ddp::transport::store::wire;
using wire::Op;

std::string g_root;

void Write(const std::string& corpus, const std::string& name, const std::string& bytes) {
  const std::string dir = g_root + "/" + corpus;
  mkdir(dir.c_str(), 0755);
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

std::string Gzip(const std::string& bytes) {
  z_stream zs;
  std::memset(&zs, 0, sizeof(zs));
  deflateInit2(&zs, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&zs, bytes.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs.avail_in = static_cast<uInt>(bytes.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// ---- store: a flags byte (see store_fuzzer.cc), then frames ----

std::string Handshake(const std::string& token, uint16_t version = wire::kVersion) {
  wire::Writer w;
  w.Bytes(std::string_view(wire::kMagic, 4));
  w.U16(version);
  w.U16(0);
  w.String(token);
  return w.Frame();
}

wire::Writer Request(Op op, uint32_t id) {
  wire::Writer w;
  w.U8(static_cast<uint8_t>(op));
  w.U32(id);
  return w;
}

std::string Set(uint32_t id, const std::string& key, const std::string& value) {
  wire::Writer w = Request(Op::kSet, id);
  w.String(key);
  w.String(value);
  return w.Frame();
}

std::string Get(uint32_t id, const std::string& key, uint32_t timeout_ms) {
  wire::Writer w = Request(Op::kGet, id);
  w.U32(timeout_ms);
  w.String(key);
  return w.Frame();
}

std::string TryGet(uint32_t id, const std::string& key) {
  wire::Writer w = Request(Op::kTryGet, id);
  w.String(key);
  return w.Frame();
}

std::string Add(uint32_t id, const std::string& key, int64_t delta) {
  wire::Writer w = Request(Op::kAdd, id);
  w.I64(delta);
  w.String(key);
  return w.Frame();
}

std::string Wait(uint32_t id, const std::vector<std::string>& keys, uint32_t timeout_ms) {
  wire::Writer w = Request(Op::kWait, id);
  w.U32(timeout_ms);
  w.U32(static_cast<uint32_t>(keys.size()));
  for (const std::string& k : keys) w.String(k);
  return w.Frame();
}

std::string Delete(uint32_t id, const std::string& key) {
  wire::Writer w = Request(Op::kDelete, id);
  w.String(key);
  return w.Frame();
}

void StoreSeeds() {
  const std::string token = "fuzz-job-token";
  const std::string kAuto = "\x01";
  Write("store", "all_ops",
        kAuto + Set(1, "rank/0/addr", "worker-address-bytes") + Get(2, "rank/0/addr", 1000) +
            TryGet(3, "missing") + TryGet(4, "rank/0/addr") + Add(5, "count", 1) +
            Add(6, "count", -3) + Wait(7, {"rank/0/addr", "count"}, 1000) +
            Delete(8, "count") + Delete(9, "count"));
  Write("store", "raw_handshake",
        std::string("\x00", 1) + Handshake(token) + Set(1, "k", "v") + Get(2, "k", 50));
  Write("store", "wrong_token", std::string("\x00", 1) + Handshake("not-the-token"));
  Write("store", "old_version", std::string("\x00", 1) + Handshake(token, 0));
  Write("store", "parked_then_set",
        std::string("\x03\x80", 2) + Get(1, "x", 5000) + Wait(2, {"x", "y"}, 5000) +
            Get(3, "never", 20) + Set(1, "x", "1") + Set(2, "y", "2"));
  Write("store", "add_overflow",
        kAuto + Set(1, "n", "9223372036854775807") + Add(2, "n", 1) + Set(3, "s", "text") +
            Add(4, "s", 1));
  Write("store", "zero_timeout", kAuto + Get(1, "absent", 0) + Wait(2, {"absent"}, 0));
  wire::Writer unknown = Request(static_cast<Op>(99), 7);
  Write("store", "unknown_op", kAuto + unknown.Frame() + Set(8, "after", "x"));
  wire::Writer huge;
  huge.U32(0x7fffffff);
  Write("store", "oversized_frame", kAuto + huge.body());
  Write("store", "empty_key", kAuto + Set(1, "", "v"));
  Write("store", "many_keys",
        kAuto + Wait(1, {"a", "b", "c", "d", "e", "f", "g", "h"}, 100) + Set(2, "a", "1"));
}

// ---- safetensors ----

void SafetensorsSeeds() {
  using namespace ddp::nn::io;
  const float f32[6] = {1, 2, 3, 4, 5, 6};
  const int64_t i64[2] = {-1, 1};
  const uint8_t u8[3] = {0, 127, 255};
  const uint16_t half[2] = {0x3c00, 0xc000};
  const double f64[1] = {3.5};
  Write("safetensors", "one_f32",
        SerializeSafetensors({{"weight", StDtype::kF32, {2, 3}, f32, sizeof(f32)}}));
  Write("safetensors", "every_dtype",
        SerializeSafetensors(
            {{"a.f32", StDtype::kF32, {6}, f32, sizeof(f32)},
             {"b.f64", StDtype::kF64, {}, f64, sizeof(f64)},
             {"c.f16", StDtype::kF16, {2}, half, sizeof(half)},
             {"d.bf16", StDtype::kBF16, {1, 2}, half, sizeof(half)},
             {"e.i64", StDtype::kI64, {2}, i64, sizeof(i64)},
             {"f.i32", StDtype::kI32, {1}, f32, 4},
             {"g.u8", StDtype::kU8, {3}, u8, sizeof(u8)},
             {"h.empty", StDtype::kF32, {0, 4}, nullptr, 0}},
            {{"format", "pt"}, {"step", "120"}}));
  Write("safetensors", "metadata_only", SerializeSafetensors({}, {{"epoch", "3"}}));
  // As the Python package writes it: no checksum, different key order.
  const std::string header =
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  file += header;
  file.append(reinterpret_cast<const char*>(f32), 8);
  Write("safetensors", "python_style", file);
}

// ---- IDX and CIFAR ----

std::string Idx(const std::vector<uint32_t>& dims) {
  std::string out = {0, 0, 8, static_cast<char>(dims.size())};
  size_t count = 1;
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(d >> shift));
    count *= d;
  }
  for (size_t i = 0; i < count; ++i) out.push_back(static_cast<char>(i * 37));
  return out;
}

void DatasetSeeds() {
  Write("idx", "labels_idx1", Idx({10}));
  Write("idx", "images_idx3", Idx({2, 4, 4}));
  Write("idx", "images_idx4", Idx({1, 1, 2, 3}));
  Write("idx", "images_idx3_gz", Gzip(Idx({3, 5, 5})));
  Write("idx", "two_gzip_members", Gzip(Idx({4}).substr(0, 6)) + Gzip(Idx({4}).substr(6)));
  Write("idx", "empty_dims", Idx({0, 28, 28}));

  std::string records;
  for (int r = 0; r < 2; ++r) {
    records.push_back(static_cast<char>(r * 7));
    for (int i = 0; i < 3072; ++i) records.push_back(static_cast<char>((i * 13 + r) & 0xff));
  }
  Write("cifar", "one_record", records.substr(0, 3073));
  Write("cifar", "two_records", records);
}

// ---- topology ----

void TopologySeeds() {
  Write("topology", "minimal", R"({"hosts":[{}],"ranks":[{"host":0}]})");
  Write("topology", "documented_example",
        R"({"hosts":[{"name":"node-a","numa_nodes":2,)"
        R"("net_devices":[{"name":"mlx5_0","port":1,"numa_node":0,"link_layer":"InfiniBand",)"
        R"("rate_gbps":200,"active":true}],)"
        R"("gpus":[{"numa_node":0,"nvlink_peers":[1]},{"numa_node":0,"nvlink_peers":[0]}]}],)"
        R"("ranks":[{"host":0,"numa_node":0,"gpu":0},{"host":0,"numa_node":0,"gpu":1}]})");
  // Two equally fast ports on node 0 for the two ranks there to share out,
  // one port on node 1, and a rank with no node that falls back to them all.
  Write("topology", "ports_to_spread",
        R"({"hosts":[{"name":"node-a","boot_id":"boot-a","numa_nodes":2,"net_devices":[)"
        R"({"name":"mlx5_0","port":1,"numa_node":0,"rate_gbps":200,"active":true},)"
        R"({"name":"mlx5_1","port":1,"numa_node":0,"rate_gbps":200,"active":true},)"
        R"({"name":"mlx5_2","port":1,"numa_node":1,"rate_gbps":100,"active":true},)"
        R"({"name":"mlx5_3","port":1,"numa_node":1,"rate_gbps":200,"active":false}],)"
        R"("gpus":[{"numa_node":0},{"numa_node":0},{"numa_node":1},{"numa_node":1}]}],)"
        R"("ranks":[{"host":0,"gpu":0},{"host":0,"gpu":1},{"host":0,"gpu":2},)"
        R"({"host":0,"gpu":3},{"host":0}]})");
  using namespace ddp::transport::topology;
  Topology t;
  for (int h = 0; h < 2; ++h) {
    Host host;
    host.name = "node-" + std::to_string(h);
    host.boot_id = "boot-" + std::to_string(h);
    host.numa_nodes = 2;
    host.net_devices = {{"mlx5_0", 1, 0, "InfiniBand", 100, true},
                        {"mlx5_1", 1, 1, "Ethernet", 25, false}};
    // Named fields: Gpu's second member is pci_bus_id, which a braced
    // {numa_node, {peer}} would fill with the peer's number as a character.
    for (int g = 0; g < 4; ++g) {
      Gpu gpu;
      gpu.numa_node = g / 2;
      gpu.nvlink_peers = {g ^ 1};
      host.gpus.push_back(gpu);
    }
    t.hosts.push_back(host);
    for (int g = 0; g < 4; ++g) t.ranks.push_back({h, g / 2, g});
  }
  Write("topology", "two_hosts_four_gpus", TopologyToJson(t));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (e.g. $PWD/tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  mkdir(g_root.c_str(), 0755);
  StoreSeeds();
  SafetensorsSeeds();
  DatasetSeeds();
  TopologySeeds();
  std::printf("seed corpora written under %s\n", g_root.c_str());
  return 0;
}
