#include "transport/launch/env.h"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "transport/topology/cpus.h"

extern char** environ;

namespace ddp::transport::launch {
namespace {

constexpr char kSlurmProcId[] = "SLURM_PROCID";
constexpr char kSlurmNtasks[] = "SLURM_NTASKS";
constexpr char kSlurmStepId[] = "SLURM_STEP_ID";
constexpr char kSlurmLocalId[] = "SLURM_LOCALID";
constexpr char kSlurmNodeId[] = "SLURM_NODEID";
constexpr char kSlurmJobId[] = "SLURM_JOB_ID";
constexpr char kSlurmNtasksPerNode[] = "SLURM_NTASKS_PER_NODE";
constexpr char kOmpiRank[] = "OMPI_COMM_WORLD_RANK";
constexpr char kOmpiSize[] = "OMPI_COMM_WORLD_SIZE";
constexpr char kOmpiLocalRank[] = "OMPI_COMM_WORLD_LOCAL_RANK";
constexpr char kOmpiLocalSize[] = "OMPI_COMM_WORLD_LOCAL_SIZE";

// Slurm caps jobs far below this; the bound only keeps a hostile
// "1(x999999999)" from allocating gigabytes.
constexpr int64_t kMaxSlurmNodes = 1 << 20;

const std::string* Find(const EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

bool Has(const EnvMap& env, std::string_view name) { return Find(env, name) != nullptr; }

// Strict decimal: optional '-', digits, nothing else.
std::optional<int64_t> ParseInt64(std::string_view text) {
  if (text.empty()) return std::nullopt;
  int64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

Status BadValue(std::string_view name, std::string_view value, std::string_view why) {
  return InvalidArgumentError(std::string(name) + "=" + std::string(value) + " " + std::string(why));
}

// Reads `name` as an integer in [lo, hi].
StatusOr<int> ReadInt(const EnvMap& env, std::string_view name, int64_t lo, int64_t hi) {
  const std::string* text = Find(env, name);
  if (text == nullptr) return InvalidArgumentError(std::string(name) + " is not set");
  std::optional<int64_t> value = ParseInt64(*text);
  if (!value) return BadValue(name, *text, "is not an integer");
  if (*value < lo || *value > hi) {
    return BadValue(name, *text,
                    "is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return static_cast<int>(*value);
}

// Reads `name` if set, else returns `fallback`.
StatusOr<int> ReadIntOr(const EnvMap& env, std::string_view name, int64_t lo, int64_t hi,
                        int fallback) {
  if (!Has(env, name)) return fallback;
  return ReadInt(env, name, lo, hi);
}

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

}  // namespace

int SlurmMasterPort(int job_id, int step_id) {
  // Steps of one allocation that run at once are separate jobs, often with
  // the same first node; ports stay below Linux's ephemeral range (32768).
  const int64_t mixed = static_cast<int64_t>(job_id) * 97 + step_id;
  return 20000 + static_cast<int>(mixed % 12768);
}

namespace {

// Fills rank, world size, local rank/size and group rank from Slurm's
// variables; the torchrun-named overrides are applied by the caller.
Status FromSlurm(const EnvMap& env, LaunchEnv& out) {
  DDP_ASSIGN_OR_RETURN(out.world_size, ReadInt(env, kSlurmNtasks, 1, kIntMax));
  DDP_ASSIGN_OR_RETURN(out.rank, ReadInt(env, kSlurmProcId, 0, kIntMax));
  DDP_ASSIGN_OR_RETURN(out.local_rank, ReadIntOr(env, kSlurmLocalId, 0, kIntMax, 0));
  DDP_ASSIGN_OR_RETURN(out.group_rank, ReadIntOr(env, kSlurmNodeId, 0, kIntMax, 0));
  // The step's own layout first: SLURM_NTASKS_PER_NODE may be the job's
  // (inherited from sbatch --ntasks-per-node) while this srun step lays its
  // tasks out otherwise.
  const bool step_layout = Has(env, "SLURM_STEP_TASKS_PER_NODE");
  if (!step_layout && Has(env, kSlurmNtasksPerNode)) {
    DDP_ASSIGN_OR_RETURN(out.local_world_size, ReadInt(env, kSlurmNtasksPerNode, 1, kIntMax));
  } else {
    const char* name = step_layout ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
    const std::string* spec = Find(env, name);
    if (spec == nullptr) {
      return InvalidArgumentError(
          "SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE are not set: cannot tell how many "
          "tasks share this node (set LOCAL_WORLD_SIZE)");
    }
    StatusOr<std::vector<int>> per_node = ExpandSlurmTasksPerNode(*spec);
    if (!per_node.ok()) {
      return InvalidArgumentError(std::string(name) + "=" + *spec + " " +
                                  per_node.status().message());
    }
    if (out.group_rank >= static_cast<int>(per_node->size())) {
      return InvalidArgumentError(std::string(name) + "=" + *spec + " has no entry for " +
                                  kSlurmNodeId + "=" + std::to_string(out.group_rank));
    }
    out.local_world_size = (*per_node)[out.group_rank];
  }
  if (!Has(env, kEnvMasterAddr)) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      const std::string* list = Find(env, name);
      if (list == nullptr) continue;
      StatusOr<std::string> host = FirstHostOfSlurmNodelist(*list);
      if (!host.ok()) {
        return InvalidArgumentError(std::string(name) + "=" + *list + " " +
                                    host.status().message());
      }
      out.master_addr = *host;
      break;
    }
  }
  if (Has(env, kSlurmJobId)) {
    DDP_ASSIGN_OR_RETURN(int job_id, ReadInt(env, kSlurmJobId, 0, kIntMax));
    DDP_ASSIGN_OR_RETURN(int step_id, ReadIntOr(env, kSlurmStepId, 0, kIntMax, 0));
    out.master_port = SlurmMasterPort(job_id, step_id);
  }
  return Status::Ok();
}

Status FromOpenMpi(const EnvMap& env, LaunchEnv& out) {
  DDP_ASSIGN_OR_RETURN(out.world_size, ReadInt(env, kOmpiSize, 1, kIntMax));
  DDP_ASSIGN_OR_RETURN(out.rank, ReadInt(env, kOmpiRank, 0, kIntMax));
  DDP_ASSIGN_OR_RETURN(out.local_rank, ReadIntOr(env, kOmpiLocalRank, 0, kIntMax, 0));
  DDP_ASSIGN_OR_RETURN(out.local_world_size,
                       ReadIntOr(env, kOmpiLocalSize, 1, kIntMax, out.world_size));
  out.group_rank = out.rank / out.local_world_size;
  return Status::Ok();
}

}  // namespace

const char* LaunchSourceName(LaunchSource source) {
  switch (source) {
    case LaunchSource::kTorchrun: return "torchrun";
    case LaunchSource::kSlurm: return "slurm";
    case LaunchSource::kOpenMpi: return "openmpi";
  }
  return "unknown";
}

std::string LaunchEnv::StoreKeyPrefix() const { return "r" + std::to_string(restart_count) + "/"; }

std::string LaunchEnv::ToString() const {
  return "rank " + std::to_string(rank) + "/" + std::to_string(world_size) + " (local " +
         std::to_string(local_rank) + "/" + std::to_string(local_world_size) + ", node " +
         std::to_string(group_rank) + ") store " + master_addr + ":" +
         std::to_string(master_port) + (store_hosted_by_launcher ? " (launcher)" : " (rank 0)") +
         " from " + LaunchSourceName(source);
}

EnvMap CurrentEnvironment() {
  EnvMap env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
  }
  return env;
}

namespace {
bool InSlurmStep(const EnvMap& env) {
  return Has(env, kSlurmProcId) && Has(env, kSlurmNtasks) && Has(env, kSlurmStepId);
}
bool UnderOpenMpi(const EnvMap& env) { return Has(env, kOmpiRank) && Has(env, kOmpiSize); }
}  // namespace

bool HasLaunchVariables(const EnvMap& env) {
  return Has(env, kEnvRank) || Has(env, kEnvWorldSize) || InSlurmStep(env) || UnderOpenMpi(env);
}

StatusOr<LaunchEnv> ParseLaunchEnv(const EnvMap& env) {
  LaunchEnv out;
  out.master_port = kDefaultMasterPort;
  const bool torchrun = Has(env, kEnvRank) || Has(env, kEnvWorldSize);
  if (torchrun) {
    if (!Has(env, kEnvRank) || !Has(env, kEnvWorldSize)) {
      const char* set = Has(env, kEnvRank) ? kEnvRank : kEnvWorldSize;
      const char* missing = Has(env, kEnvRank) ? kEnvWorldSize : kEnvRank;
      return InvalidArgumentError(std::string(set) + "=" + *Find(env, set) + " is set but " +
                                  missing + " is not");
    }
    out.source = LaunchSource::kTorchrun;
    DDP_ASSIGN_OR_RETURN(out.world_size, ReadInt(env, kEnvWorldSize, 1, kIntMax));
    DDP_ASSIGN_OR_RETURN(out.rank, ReadInt(env, kEnvRank, 0, kIntMax));
    out.local_world_size = out.world_size;
    // Without LOCAL_RANK or GROUP_RANK: the rank within its node and the
    // node's index, as torchrun lays ranks out (node by node,
    // LOCAL_WORLD_SIZE each). RANK itself is the local rank, and the node
    // the first, only where one node holds the whole job.
    out.local_rank = out.rank;
    if (Has(env, kEnvLocalWorldSize)) {
      DDP_ASSIGN_OR_RETURN(const int local_size, ReadInt(env, kEnvLocalWorldSize, 1, kIntMax));
      out.local_rank = out.rank % local_size;
      out.group_rank = out.rank / local_size;
    }
  } else if (InSlurmStep(env)) {
    out.source = LaunchSource::kSlurm;
    DDP_RETURN_IF_ERROR(FromSlurm(env, out));
  } else if (UnderOpenMpi(env)) {
    out.source = LaunchSource::kOpenMpi;
    DDP_RETURN_IF_ERROR(FromOpenMpi(env, out));
  } else {
    return NotFoundError(
        "no launch variables: RANK and WORLD_SIZE are not set and this is not an srun step "
        "or an mpirun process");
  }

  // Explicit variables override whatever the scheduler said.
  DDP_ASSIGN_OR_RETURN(out.local_rank, ReadIntOr(env, kEnvLocalRank, 0, kIntMax, out.local_rank));
  DDP_ASSIGN_OR_RETURN(out.local_world_size, ReadIntOr(env, kEnvLocalWorldSize, 1, kIntMax,
                                                       out.local_world_size));
  DDP_ASSIGN_OR_RETURN(out.group_rank, ReadIntOr(env, kEnvGroupRank, 0, kIntMax, out.group_rank));
  DDP_ASSIGN_OR_RETURN(out.master_port,
                       ReadIntOr(env, kEnvMasterPort, 1, 65535, out.master_port));
  // torchrun's count where ddprun's is not set: a program run by torchrun
  // with --max_restarts learns it was restarted (and may resume).
  const char* restart_name = Has(env, kEnvRestartCount) ? kEnvRestartCount : kEnvTorchRestartCount;
  DDP_ASSIGN_OR_RETURN(out.restart_count, ReadIntOr(env, restart_name, 0, kIntMax, 0));
  if (const std::string* id = Find(env, kEnvRunId)) {
    out.run_id = *id;
  } else if (const std::string* torch_id = Find(env, kEnvTorchRunId); torch_id != nullptr && *torch_id != "none") {
    out.run_id = *torch_id;
  }
  if (const std::string* addr = Find(env, kEnvMasterAddr)) {
    if (addr->empty()) return InvalidArgumentError("MASTER_ADDR is set but empty");
    out.master_addr = *addr;
  }
  // Where this job's own store is, when not at MASTER_ADDR:MASTER_PORT.
  if (const std::string* addr = Find(env, kEnvStoreAddr)) {
    if (addr->empty()) return InvalidArgumentError("DDP_STORE_ADDR is set but empty");
    out.master_addr = *addr;
  }
  if (Has(env, kEnvStorePort)) {
    DDP_ASSIGN_OR_RETURN(out.master_port, ReadInt(env, kEnvStorePort, 1, 65535));
  }

  // Names of the variables that supplied each field, for the messages below.
  const char* rank_name = kEnvRank;
  const char* size_name = kEnvWorldSize;
  if (out.source == LaunchSource::kSlurm) {
    rank_name = kSlurmProcId;
    size_name = kSlurmNtasks;
  } else if (out.source == LaunchSource::kOpenMpi) {
    rank_name = kOmpiRank;
    size_name = kOmpiSize;
  }
  const char* local_rank_name = kEnvLocalRank;
  const char* local_size_name = kEnvLocalWorldSize;
  if (!Has(env, kEnvLocalRank) && out.source == LaunchSource::kSlurm) local_rank_name = kSlurmLocalId;
  if (!Has(env, kEnvLocalRank) && out.source == LaunchSource::kOpenMpi) local_rank_name = kOmpiLocalRank;
  if (!Has(env, kEnvLocalWorldSize) && out.source == LaunchSource::kOpenMpi) local_size_name = kOmpiLocalSize;
  if (!Has(env, kEnvLocalWorldSize) && out.source == LaunchSource::kSlurm) {
    // As FromSlurm took it.
    local_size_name = Has(env, "SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                      : Has(env, kSlurmNtasksPerNode)       ? kSlurmNtasksPerNode
                                                            : "SLURM_TASKS_PER_NODE";
  }

  auto named = [](const char* name, int value) { return std::string(name) + "=" + std::to_string(value); };
  if (out.rank >= out.world_size) {
    return InvalidArgumentError(named(rank_name, out.rank) + " is not below " +
                                named(size_name, out.world_size));
  }
  if (out.local_world_size > out.world_size) {
    return InvalidArgumentError(named(local_size_name, out.local_world_size) +
                                " is larger than " + named(size_name, out.world_size));
  }
  if (out.local_rank >= out.local_world_size) {
    return InvalidArgumentError(named(local_rank_name, out.local_rank) + " is not below " +
                                named(local_size_name, out.local_world_size));
  }
  // Every node holds at least one rank: besides this node's
  // LOCAL_WORLD_SIZE, the other ranks leave room for at most WORLD_SIZE -
  // LOCAL_WORLD_SIZE other nodes, so the node's index is at most that (0 on
  // a job of one node). A larger one would name a node that cannot exist.
  const char* group_rank_name = Has(env, kEnvGroupRank)                                   ? kEnvGroupRank
                                : out.source == LaunchSource::kSlurm && Has(env, kSlurmNodeId) ? kSlurmNodeId
                                                                                         : nullptr;
  if (group_rank_name != nullptr && out.group_rank > out.world_size - out.local_world_size) {
    // Unset under torchrun's names, the local world size is the whole job.
    const std::string local = out.source == LaunchSource::kTorchrun && !Has(env, kEnvLocalWorldSize)
                                  ? std::string(kEnvLocalWorldSize) + " unset (every rank on this node)"
                                  : named(local_size_name, out.local_world_size) + " on this node";
    return InvalidArgumentError(named(group_rank_name, out.group_rank) + " is out of range: " +
                                named(size_name, out.world_size) + " with " + local +
                                " leaves room for node indices 0.." +
                                std::to_string(out.world_size - out.local_world_size));
  }
  if (out.master_addr.empty()) {
    if (out.multi_node()) {
      return InvalidArgumentError("MASTER_ADDR is not set but " + named(size_name, out.world_size) +
                                  " spans more than one node (" +
                                  named(local_size_name, out.local_world_size) +
                                  "): set MASTER_ADDR to the host of the store");
    }
    out.master_addr = "127.0.0.1";
  }

  if (const std::string* token = Find(env, kEnvJobToken)) {
    if (token->size() > kMaxJobTokenBytes) {
      return InvalidArgumentError("DDP_JOB_TOKEN is " + std::to_string(token->size()) +
                                  " bytes long, more than the limit of " +
                                  std::to_string(kMaxJobTokenBytes));
    }
    out.job_token = *token;
  }
  if (const std::string* host = Find(env, kEnvStoreHost)) {
    if (*host == "launcher") {
      out.store_hosted_by_launcher = true;
    } else if (*host != "rank0" && !host->empty()) {
      return BadValue(kEnvStoreHost, *host, "is neither `launcher` nor `rank0`");
    }
  }
  // torchrun's agent already listens on MASTER_PORT (with PyTorch's store
  // protocol); rank 0 serves ours next to it.
  const std::string* agent = Find(env, kEnvTorchAgentStore);
  if (agent != nullptr && *agent == "True" && !Has(env, kEnvStorePort) && !out.store_hosted_by_launcher) {
    if (out.master_port == 65535) {
      return InvalidArgumentError(
          "torchrun's agent serves MASTER_PORT=65535 (TORCHELASTIC_USE_AGENT_STORE=True) and there is "
          "no port after it for this job's store: set DDP_STORE_PORT to a free port on MASTER_ADDR");
    }
    out.master_port += 1;
    out.store_port_beside_torch_agent = true;
  }
  return out;
}

StatusOr<LaunchEnv> LaunchEnvFromProcess() { return ParseLaunchEnv(CurrentEnvironment()); }

std::vector<std::pair<std::string, std::string>> ToEnvironment(const LaunchEnv& env) {
  std::vector<std::pair<std::string, std::string>> vars = {
      {kEnvRank, std::to_string(env.rank)},
      {kEnvWorldSize, std::to_string(env.world_size)},
      {kEnvLocalRank, std::to_string(env.local_rank)},
      {kEnvLocalWorldSize, std::to_string(env.local_world_size)},
      {kEnvGroupRank, std::to_string(env.group_rank)},
      {kEnvMasterAddr, env.master_addr},
      {kEnvMasterPort, std::to_string(env.master_port)},
      {kEnvRestartCount, std::to_string(env.restart_count)},
      {kEnvStoreHost, env.store_hosted_by_launcher ? "launcher" : "rank0"},
      {kEnvStoreAddr, env.master_addr},
      {kEnvStorePort, std::to_string(env.master_port)},
  };
  if (!env.job_token.empty()) vars.emplace_back(kEnvJobToken, env.job_token);
  if (!env.run_id.empty()) vars.emplace_back(kEnvRunId, env.run_id);
  return vars;
}

StatusOr<std::string> FirstHostOfSlurmNodelist(std::string_view nodelist) {
  // Only the first top-level item matters; inside it, each bracket group
  // contributes its first element ("01-04,7" -> "01").
  std::string host;
  bool in_bracket = false;
  bool took_bracket_value = false;
  bool range_ended = false;
  for (char c : nodelist) {
    if (!in_bracket) {
      if (c == ',') break;
      if (c == '[') {
        in_bracket = true;
        took_bracket_value = false;
        range_ended = false;
        continue;
      }
      if (c == ']') return InvalidArgumentError("has a `]` without a matching `[`");
      host.push_back(c);
      continue;
    }
    if (c == ']') {
      if (!took_bracket_value) return InvalidArgumentError("has an empty `[]` range");
      in_bracket = false;
      continue;
    }
    if (c == '[') return InvalidArgumentError("has nested `[`");
    if (c == ',' || c == '-') {
      range_ended = true;
      continue;
    }
    if (c < '0' || c > '9') return InvalidArgumentError("has a non-digit inside `[...]`");
    if (!range_ended) {
      host.push_back(c);
      took_bracket_value = true;
    }
  }
  if (in_bracket) return InvalidArgumentError("has a `[` without a matching `]`");
  if (host.empty()) return InvalidArgumentError("names no host");
  return host;
}

StatusOr<std::vector<int>> ExpandSlurmTasksPerNode(std::string_view spec) {
  std::vector<int> out;
  if (spec.empty()) return InvalidArgumentError("is empty");
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string_view item = spec.substr(pos, comma == std::string_view::npos ? spec.npos : comma - pos);
    std::string_view count_text = item;
    int64_t repeat = 1;
    size_t paren = item.find('(');
    if (paren != std::string_view::npos) {
      count_text = item.substr(0, paren);
      std::string_view rest = item.substr(paren);
      if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')') {
        return InvalidArgumentError("has a malformed repeat `" + std::string(item) + "`");
      }
      std::optional<int64_t> r = ParseInt64(rest.substr(2, rest.size() - 3));
      if (!r || *r < 1) {
        return InvalidArgumentError("has a malformed repeat `" + std::string(item) + "`");
      }
      repeat = *r;
    }
    std::optional<int64_t> count = ParseInt64(count_text);
    if (!count || *count < 1 || *count > kIntMax) {
      return InvalidArgumentError("has a malformed task count `" + std::string(item) + "`");
    }
    if (static_cast<int64_t>(out.size()) + repeat > kMaxSlurmNodes) {
      return InvalidArgumentError("describes more than " + std::to_string(kMaxSlurmNodes) +
                                  " nodes");
    }
    out.insert(out.end(), static_cast<size_t>(repeat), static_cast<int>(*count));
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

namespace {

// Python's whitespace among the ASCII characters: \t\n\v\f\r, the
// file/group/record/unit separators \x1c-\x1f, and the space.
bool IsPythonSpace(char c) { return (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= ' '); }

}  // namespace

std::string_view StripPythonSpace(std::string_view text) {
  while (!text.empty() && IsPythonSpace(text.front())) text.remove_prefix(1);
  while (!text.empty() && IsPythonSpace(text.back())) text.remove_suffix(1);
  return text;
}

std::optional<std::string> PythonIntDigits(std::string_view text) {
  text = StripPythonSpace(text);
  std::string digits;
  if (!text.empty() && (text.front() == '+' || text.front() == '-')) {
    if (text.front() == '-') digits = "-";
    text.remove_prefix(1);
  }
  if (text.empty()) return std::nullopt;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '_') {
      // Only between two digits.
      if (i == 0 || i + 1 == text.size() || text[i - 1] == '_') return std::nullopt;
      continue;
    }
    if (c < '0' || c > '9') return std::nullopt;
    digits += c;
  }
  return digits;
}

std::optional<int64_t> ParsePythonInt(std::string_view text) {
  const std::optional<std::string> digits = PythonIntDigits(text);
  if (!digits) return std::nullopt;
  const bool negative = (*digits)[0] == '-';
  const std::string_view magnitude = std::string_view(*digits).substr(negative ? 1 : 0);
  int64_t v = 0;
  if (std::from_chars(magnitude.data(), magnitude.data() + magnitude.size(), v).ec ==
      std::errc::result_out_of_range) {
    return negative ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
  }
  return negative ? -v : v;
}

int VisibleGpuCount(const EnvMap& env, const std::string& proc_gpus) {
  // The GPUs the driver lists (every GPU of the host, or of the container).
  int listed = 0;
  if (DIR* dir = opendir(proc_gpus.c_str())) {
    while (const dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') ++listed;
    }
    closedir(dir);
  }
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it == env.end()) return listed;
  // As CUDA reads it, and torch.cuda.device_count() with it: entries (blanks
  // around them dropped) up to the first that is neither an index nor a
  // GPU-/MIG- UUID ("-1", the usual way to hide every GPU, ends it), or an
  // index beyond the GPUs the driver lists; a repeated entry makes it name
  // none at all.
  std::vector<std::string_view> seen;
  size_t start = 0;
  const std::string& list = it->second;
  while (start < list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string_view entry(list.data() + start, end - start);
    start = end + 1;
    while (!entry.empty() && std::isspace(static_cast<unsigned char>(entry.front()))) entry.remove_prefix(1);
    while (!entry.empty() && std::isspace(static_cast<unsigned char>(entry.back()))) entry.remove_suffix(1);
    const bool index = !entry.empty() && entry.find_first_not_of("0123456789") == std::string_view::npos;
    const bool uuid = entry.substr(0, 4) == "GPU-" || entry.substr(0, 4) == "MIG-";
    if (!index && !uuid) break;
    if (index && listed > 0) {
      int64_t ordinal = 0;
      const auto [ptr, ec] = std::from_chars(entry.data(), entry.data() + entry.size(), ordinal);
      if (ec != std::errc() || ordinal >= listed) break;
    }
    if (std::find(seen.begin(), seen.end(), entry) != seen.end()) return 0;
    seen.push_back(entry);
  }
  return static_cast<int>(seen.size());
}

StatusOr<int> ParseNprocPerNode(std::string_view text, const EnvMap& env, const std::string& proc_gpus) {
  const std::string flag = "--nproc_per_node=" + std::string(text);
  if (text == "gpu" || text == "auto") {
    const int gpus = VisibleGpuCount(env, proc_gpus);
    if (gpus > 0) return std::min(gpus, kMaxProcPerNode);
    if (text == "gpu") {
      return InvalidArgumentError(flag + ": no GPU is visible (" +
                                  (env.count("CUDA_VISIBLE_DEVICES") != 0
                                       ? "CUDA_VISIBLE_DEVICES='" + env.find("CUDA_VISIBLE_DEVICES")->second +
                                             "' names none"
                                       : proc_gpus + " lists none") +
                                  ")");
    }
  }
  if (text == "cpu" || text == "auto") {
    // The CPUs this launcher may keep busy: a container's quota (--cpus)
    // caps the affinity mask, which lists every core of the host there.
    return std::clamp(topology::UsableCpus(), 1, kMaxProcPerNode);
  }
  // torchrun tries int() first, so "+2", " 4\n" and "1_0" are numbers; its
  // words must be exact (" gpu" is neither).
  const std::optional<int64_t> n = ParsePythonInt(text);
  if (!n) return InvalidArgumentError(flag + " is not an integer, gpu, cpu or auto");
  if (*n < 1 || *n > kMaxProcPerNode) {
    return InvalidArgumentError(flag + " must be in [1, " + std::to_string(kMaxProcPerNode) + "]");
  }
  return static_cast<int>(*n);
}

}  // namespace ddp::transport::launch
