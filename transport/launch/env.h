#ifndef DDP_TRANSPORT_LAUNCH_ENV_H_
#define DDP_TRANSPORT_LAUNCH_ENV_H_

// The launch environment of one worker: who it is (rank, local rank, node),
// how big the job is, where the rendezvous store lives and the job token that
// lets it in. Parsed from environment variables set by `ddprun`, by
// `SelfLaunch`, by torchrun-style scripts, or by a scheduler (Slurm's `srun`,
// Open MPI's `mpirun`).
//
// Precedence (documented for users in transport/launch/README.md):
//
//  1. torchrun variables. When RANK or WORLD_SIZE is set, both must be, and
//     the scheduler variables are ignored altogether. LOCAL_WORLD_SIZE
//     defaults to WORLD_SIZE (one node), LOCAL_RANK to RANK % LOCAL_WORLD_SIZE
//     (ranks laid out node by node, as torchrun does), GROUP_RANK to 0.
//  2. Slurm, inside an `srun` step (SLURM_PROCID, SLURM_NTASKS and
//     SLURM_STEP_ID set; the batch script itself has no step id and is not a
//     rank): RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS,
//     LOCAL_RANK=SLURM_LOCALID, GROUP_RANK=SLURM_NODEID, LOCAL_WORLD_SIZE from
//     this node's entry of the step's SLURM_STEP_TASKS_PER_NODE ("2(x3),1"
//     form), else SLURM_NTASKS_PER_NODE (perhaps the job's), else
//     SLURM_TASKS_PER_NODE. MASTER_ADDR defaults to the
//     first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST
//     ("node[01-04,7],gpu3" forms), MASTER_PORT to SlurmMasterPort(
//     SLURM_JOB_ID, SLURM_STEP_ID), so that every task of the step agrees on
//     it without talking and steps running at once do not.
//  3. Open MPI (OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE set):
//     RANK, WORLD_SIZE, LOCAL_RANK=OMPI_COMM_WORLD_LOCAL_RANK,
//     LOCAL_WORLD_SIZE=OMPI_COMM_WORLD_LOCAL_SIZE; GROUP_RANK defaults to
//     RANK / LOCAL_WORLD_SIZE (mpirun's default by-slot placement).
//
// Under a scheduler, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
// MASTER_PORT each override the scheduler's value when set. Everywhere:
// MASTER_ADDR defaults to 127.0.0.1 on a single node and is required across
// nodes; MASTER_PORT defaults to 29500 (torchrun's) outside Slurm;
// DDP_RESTART_COUNT defaults to torchrun's TORCHELASTIC_RESTART_COUNT, else 0;
// DDP_RUN_ID defaults to torchrun's TORCHELASTIC_RUN_ID (its rendezvous id;
// "none", torchrun's default for a static rendezvous, counts as no id), else
// empty; DDP_JOB_TOKEN defaults to empty (no token:
// anyone who can reach the store can join it); DDP_STORE_HOST=launcher means a
// launcher process serves the store, otherwise (unset or `rank0`) rank 0 does.
//
// The store is this job's own (transport/store), not PyTorch's TCPStore, so it
// can be kept off MASTER_ADDR:MASTER_PORT: DDP_STORE_ADDR and DDP_STORE_PORT,
// when set, say where it is instead. ddprun sets them and leaves MASTER_PORT
// free for a PyTorch program's own rendezvous. Under a torchrun whose agent
// serves MASTER_PORT itself (TORCHELASTIC_USE_AGENT_STORE=True, PyTorch 2's
// default) and without DDP_STORE_PORT, rank 0 serves the store on
// MASTER_PORT + 1.
//
// Every inconsistency is INVALID_ARGUMENT with a one-line message that names
// the variable and its value.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "transport/status.h"

namespace ddp::transport::launch {

/// Where the rank and world size came from. Values are stable: append only.
enum class LaunchSource : int {
  kTorchrun = 0,  ///< RANK / WORLD_SIZE (ddprun, SelfLaunch, torchrun).
  kSlurm = 1,     ///< An srun step.
  kOpenMpi = 2,   ///< mpirun from Open MPI.
};

/// "torchrun", "slurm", "openmpi".
const char* LaunchSourceName(LaunchSource source);

/// Everything a worker learns from its environment.
struct LaunchEnv {
  int rank = 0;                  ///< Global rank in [0, world_size).
  int world_size = 1;            ///< Number of ranks in the job.
  int local_rank = 0;            ///< Rank among the workers of this node.
  int local_world_size = 1;      ///< Number of workers on this node.
  int group_rank = 0;            ///< Index of this node (torchrun's GROUP_RANK).
  std::string master_addr;       ///< Host of the store (DDP_STORE_ADDR, else MASTER_ADDR).
  int master_port = 0;           ///< TCP port of the store, in [1, 65535].
  int restart_count = 0;         ///< How many times the group was restarted.
  std::string job_token;         ///< Shared secret of the job; empty: none.
  /// The same in every worker of one run of the job, through its restarts
  /// (DDP_RUN_ID, else TORCHELASTIC_RUN_ID); empty: the launcher gave none.
  std::string run_id;
  bool store_hosted_by_launcher = false;  ///< Else rank 0 serves the store.
  /// torchrun's agent holds MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True)
  /// and no DDP_STORE_PORT was given: the store is on MASTER_PORT + 1.
  bool store_port_beside_torch_agent = false;
  LaunchSource source = LaunchSource::kTorchrun;

  /// True when the job spans more than this node.
  bool multi_node() const { return world_size > local_world_size; }
  /// True when this process must serve the store itself (rank 0, no launcher).
  bool hosts_store() const { return rank == 0 && !store_hosted_by_launcher; }
  /// "r<restart_count>/": prefix for store keys, so that a restarted group
  /// never reads what the previous attempt wrote.
  std::string StoreKeyPrefix() const;
  /// "rank 1/4 (local 1/2, node 0) store 127.0.0.1:29500 from torchrun".
  std::string ToString() const;
};

/// Variable names, shared by the parser and the launchers that set them.
inline constexpr char kEnvRank[] = "RANK";
inline constexpr char kEnvWorldSize[] = "WORLD_SIZE";
inline constexpr char kEnvLocalRank[] = "LOCAL_RANK";
inline constexpr char kEnvLocalWorldSize[] = "LOCAL_WORLD_SIZE";
inline constexpr char kEnvGroupRank[] = "GROUP_RANK";
inline constexpr char kEnvMasterAddr[] = "MASTER_ADDR";
inline constexpr char kEnvMasterPort[] = "MASTER_PORT";
inline constexpr char kEnvRestartCount[] = "DDP_RESTART_COUNT";
inline constexpr char kEnvJobToken[] = "DDP_JOB_TOKEN";
/// Set by ddprun: the same in every worker of one ddprun run (every node,
/// every restart), different in the next run, whatever its token: what a
/// program uses to tell its own checkpoints from an earlier run's.
inline constexpr char kEnvRunId[] = "DDP_RUN_ID";
inline constexpr char kEnvStoreHost[] = "DDP_STORE_HOST";
inline constexpr char kEnvStoreAddr[] = "DDP_STORE_ADDR";
inline constexpr char kEnvStorePort[] = "DDP_STORE_PORT";
/// "True" when torchrun's agent serves MASTER_PORT (workers only connect).
inline constexpr char kEnvTorchAgentStore[] = "TORCHELASTIC_USE_AGENT_STORE";
/// torchrun's restart count and run (rendezvous) id, read where ddprun's
/// DDP_RESTART_COUNT and DDP_RUN_ID are not set.
inline constexpr char kEnvTorchRestartCount[] = "TORCHELASTIC_RESTART_COUNT";
inline constexpr char kEnvTorchRunId[] = "TORCHELASTIC_RUN_ID";

/// MASTER_PORT when nothing sets it (torchrun's default).
inline constexpr int kDefaultMasterPort = 29500;
/// MASTER_PORT under Slurm: 20000 + (job id * 97 + step id) % 12768, in
/// [20000, 32768), below Linux's ephemeral ports.
int SlurmMasterPort(int job_id, int step_id);
/// Longest accepted DDP_JOB_TOKEN, in bytes.
inline constexpr size_t kMaxJobTokenBytes = 256;

/// A snapshot of environment variables, name -> value.
using EnvMap = std::map<std::string, std::string, std::less<>>;

/// The current process's environment.
EnvMap CurrentEnvironment();

/// True when `env` names this process as one worker of a launched job: RANK or
/// WORLD_SIZE is set, or it runs inside an srun step, or under mpirun.
bool HasLaunchVariables(const EnvMap& env);

/// Parses `env` by the precedence rules above. NOT_FOUND when there are no
/// launch variables at all; INVALID_ARGUMENT naming the variable otherwise.
StatusOr<LaunchEnv> ParseLaunchEnv(const EnvMap& env);

/// ParseLaunchEnv(CurrentEnvironment()).
StatusOr<LaunchEnv> LaunchEnvFromProcess();

/// The variables a launcher sets for a worker so that ParseLaunchEnv gives
/// back `env` (source is always kTorchrun; an empty token is left out). The
/// store's address is given twice, as MASTER_ADDR/MASTER_PORT and as
/// DDP_STORE_ADDR/DDP_STORE_PORT, so that a launcher may point MASTER_PORT
/// elsewhere.
std::vector<std::pair<std::string, std::string>> ToEnvironment(const LaunchEnv& env);

/// `text` without the Python whitespace around it (str.strip()'s ASCII
/// characters: \t\n\v\f\r, \x1c to \x1f and the space).
std::string_view StripPythonSpace(std::string_view text);

/// `text` as Python's int() reads a base-10 string, which is how torchrun
/// reads its integer flags, its PET_ switches and its --rdzv_conf counts:
/// Python whitespace around it, an optional sign, decimal digits with single
/// underscores between two digits ("1", " +2\n", "-007", "29_500"). Returns
/// the digits without the underscores, after a '-' if negative; nullopt for
/// anything int() refuses ("", "1__0", "_1", "1_", "1.0", "0x1", "1 0").
std::optional<std::string> PythonIntDigits(std::string_view text);

/// PythonIntDigits' number. One beyond int64's range comes back as int64's
/// bound on its side, for the caller's range check to refuse as out of
/// range rather than as no integer.
std::optional<int64_t> ParsePythonInt(std::string_view text);

/// Most workers one node may run.
inline constexpr int kMaxProcPerNode = 4096;
/// Where the NVIDIA driver lists the GPUs (one entry per GPU).
inline constexpr char kNvidiaProcGpus[] = "/proc/driver/nvidia/gpus";

/// GPUs this process may use, as torch.cuda.device_count() counts them: the
/// entries of CUDA_VISIBLE_DEVICES when it is set (empty: none; up to one
/// that names no GPU, or an index beyond those `proc_gpus` lists; a repeated
/// one: none), otherwise the entries of `proc_gpus` (0 when absent).
int VisibleGpuCount(const EnvMap& env, const std::string& proc_gpus = kNvidiaProcGpus);

/// The value of --nproc_per_node, in torchrun's forms: a number in [1,
/// kMaxProcPerNode] as Python's int() reads it (see ParsePythonInt), `gpu` (one worker per visible GPU), `cpu` (one per CPU
/// this process may run on) or `auto` (gpu when there is one, else cpu).
/// INVALID_ARGUMENT naming the flag otherwise, and for `gpu` without GPUs.
StatusOr<int> ParseNprocPerNode(std::string_view text, const EnvMap& env,
                                const std::string& proc_gpus = kNvidiaProcGpus);

/// First host of a Slurm node list: "node[01-04,7],gpu3" -> "node01".
/// Supports comma-separated names, each with bracketed ranges and lists.
StatusOr<std::string> FirstHostOfSlurmNodelist(std::string_view nodelist);

/// Expands Slurm's tasks-per-node notation: "2(x3),1" -> {2, 2, 2, 1}.
StatusOr<std::vector<int>> ExpandSlurmTasksPerNode(std::string_view spec);

}  // namespace ddp::transport::launch

#endif  // DDP_TRANSPORT_LAUNCH_ENV_H_
