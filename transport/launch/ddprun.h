#ifndef DDP_TRANSPORT_LAUNCH_DDPRUN_H_
#define DDP_TRANSPORT_LAUNCH_DDPRUN_H_

// ddprun, the launcher: flags in torchrun's spelling, one launcher per node,
// node 0 serving the rendezvous store for the whole job.
//
//   ddprun [flags] [--] PROGRAM [ARGS...]
//
// Several nodes: every launcher gets the same flags except --node_rank, and
// the same job token through the environment (DDP_JOB_TOKEN, which schedulers
// propagate and `ps` does not show) or --job_token. The launchers meet in the
// store under "ddprun/": each registers, checks that node 0's flags match its
// own, and starts its workers once every node is there. While the workers
// run, each launcher beats a heartbeat and watches for a failure notice; the
// first launcher whose workers fail posts the reason, and every launcher
// stops its workers. Node 0 declares a node dead when its heartbeat stops
// for --node_timeout; the other nodes stop when node 0's store goes away.
// With --rdzv_backend=c10d (torchrun's dynamic rendezvous) the launchers
// take no --node_rank: the one that can listen on the endpoint's address
// and port serves the store and is node 0; the others take node ranks 1,
// 2, ... in the order they join. As under torchrun, every start and
// restart forms the membership anew (a round): the nodes of the last round
// come back first and keep their node ranks, a node that died drops out
// (waiting launchers beat a heartbeat too: node 0 seats none silent for
// --node_timeout when the round closes, nor one that took its slot before
// the round opened, a spare, until it saw it beat, nor one that does not
// beat once more after the round closed),
// and a relaunched or new launcher takes a free place; launchers beyond
// --nnodes wait as spares for a restart (within --rdzv_timeout) and leave
// with the job's exit status. With --nnodes=MIN:MAX (c10d only) node 0
// waits for MIN nodes, then up to the last call
// (--rdzv_conf=last_call_timeout=SEC, default 30) for more, and closes the
// round; a launcher arriving while the job runs on fewer than MAX nodes
// makes node 0 restart the workers with it, which does not count against
// --max_restarts.
// With --max_restarts=K the whole job (every node) restarts up to K times
// after failures, DDP_RESTART_COUNT counting every start of the workers
// (TORCHELASTIC_RESTART_COUNT only the failures); an interrupted launcher
// (SIGINT, SIGTERM, SIGHUP, SIGQUIT) stops the job without a restart: before it
// passes the signal to its workers it posts a stop for the attempt, which
// overrides the restartable notices of the nodes whose workers then fail,
// and which a rendezvous for a restart already under way honours at once.
// SIGUSR1 and SIGUSR2 while the workers run are passed on to them (a
// checkpoint hook, such as Slurm's --signal=USR1@T) and stop nothing.
//
// Exit status: 0 when every worker of every node succeeded; 1 when a worker
// failed, on every node, as under torchrun (the reason line and the error
// file name the rank and its exit code or signal: passed through, a worker's
// 2 or 137 would read as ddprun's bad input or a killed launcher), and for
// rendezvous failures; 128 + signal when interrupted
// (ddprun's main then dies of SIGINT, SIGTERM or SIGHUP instead: see
// DieOfInterruptSignal); 2 for bad input, reported on one line before
// anything starts (workers that cannot start for lack of resources, such
// as descriptors, exit 1 with a line that says so).

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "transport/launch/env.h"
#include "transport/status.h"

namespace ddp::transport::launch {

/// torchrun's -t/--tee or -r/--redirects value: one stream code for every
/// local rank ("3"), or one per local rank ("0:3,1:2", the others 0). A
/// code is 0 (none), 1 (stdout), 2 (stderr) or 3 (both).
struct StreamCodes {
  int all = 0;                ///< Every local rank's, when by_rank is empty.
  std::map<int, int> by_rank;  ///< Local rank -> code; ranks not named: 0.
  int For(int local_rank) const {
    if (by_rank.empty()) return all;
    const auto it = by_rank.find(local_rank);
    return it == by_rank.end() ? 0 : it->second;
  }
  /// Whether any of local ranks 0..nproc-1 has a stream here.
  bool Any(int nproc) const {
    for (int local = 0; local < nproc; ++local) {
      if (For(local) != 0) return true;
    }
    return false;
  }
};

struct DdprunOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  /// "static" (every node gives --node_rank) or "c10d" (node ranks are
  /// assigned as the launchers join; see above).
  std::string rdzv_backend = "static";
  /// Taken from the join order (c10d with several nodes); node_rank is
  /// then only known once RunDdprun has met the store.
  bool assign_node_rank = false;
  std::string rdzv_id;           ///< Job id; every node must give the same.
  /// Elastic job (--nnodes=MIN:MAX, c10d only): nnodes holds MAX; each
  /// round runs on as many nodes as joined, at least min_nodes, waiting up
  /// to last_call for more once min_nodes are in.
  int min_nodes = 0;             ///< 0: not elastic.
  /// --nnodes as N, or MIN:MAX when elastic, however it was spelled
  /// ("+2", "2:2"); compared across nodes. Empty: not given (1).
  std::string nnodes_spec;
  std::chrono::milliseconds last_call{30000};
  std::string master_addr;       ///< Empty: 127.0.0.1 (one node only).
  int master_port = kDefaultMasterPort;
  bool standalone = false;       ///< One node, 127.0.0.1, a free port.
  int max_restarts = 0;
  /// This run's folder goes under it: the workers' error files, and with
  /// tee or redirects their log files, under attempt_<k>/.
  std::string log_dir;
  /// Per local rank, the streams (torchrun's -t/-r codes, the bits of
  /// spawn.h's kStdoutStream and kStderrStream) that go to its log files
  /// and the terminal (tee) or to its log files only (redirects; tee wins).
  StreamCodes tee;
  StreamCodes redirects;
  /// --tee or --redirects without --log_dir: as torchrun, the logs go to a
  /// fresh $TMPDIR/torchelastic_XXXXXX (RunDdprun makes it and names it).
  bool temp_log_dir = false;
  bool prefix = true;            ///< "[rank] " on terminal lines (when >1 worker).
  /// --local_ranks_filter: only these local ranks' output reaches the
  /// terminal (log files get all); empty: every rank's. Sorted, unique.
  std::vector<int> local_ranks_filter;
  std::string job_token;         ///< From --job_token or DDP_JOB_TOKEN.
  /// Waiting for all nodes; 600 s, torchrun's join timeout.
  std::chrono::milliseconds rdzv_timeout{600000};
  std::chrono::milliseconds node_timeout{30000};   ///< Heartbeat silence = dead node.
  std::chrono::milliseconds grace{30000};          ///< SIGTERM -> SIGKILL; 30 s, torchrun's.
  std::chrono::milliseconds max_run_time{0};       ///< Per attempt; 0: no limit.
  /// --exec_timeout: how long one worker's exec may take (SpawnOptions::
  /// exec_timeout); more than 0.
  std::chrono::milliseconds exec_timeout{60000};
  /// Deadline of one bookkeeping call on the store (torchrun's
  /// --rdzv_conf=read_timeout); at most --node_timeout counts.
  std::chrono::milliseconds store_call_time{10000};
  /// c10d only (--rdzv_conf=is_host): true, this launcher must serve the
  /// store; false, it joins; unset, it serves if it can listen on the
  /// endpoint.
  std::optional<bool> is_host;
  std::string role = "default";  ///< --role: the workers' ROLE_NAME.
  /// torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE from the launcher's
  /// environment: with $rank, $local_rank and $role_name (or ${...}), the
  /// prefix of the workers' terminal lines instead of "[rank] ". Empty:
  /// "[rank] ".
  std::string line_prefix_template;
  /// --virtual_local_rank (torchrun's): worker L gets LOCAL_RANK=0 and
  /// CUDA_VISIBLE_DEVICES=virtual_devices[L], one device each (the L-th of
  /// the launcher's CUDA_VISIBLE_DEVICES, else L). Empty: off.
  std::vector<std::string> virtual_devices;
  /// TORCHELASTIC_ERROR_FILE of the launcher's own environment (its own
  /// launcher or scheduler asked for its error), taken before the workers
  /// get theirs. On a failure RunDdprun writes the root-cause worker's
  /// error there, else its own reason, as torchrun's @record does. Empty:
  /// none asked.
  std::string error_file;
  /// One line each about torchrun flags that were accepted but mean nothing
  /// here; RunDdprun prints them.
  std::vector<std::string> notes;
  std::vector<std::string> command;  ///< PROGRAM and its arguments.
  bool help = false;
};

/// Parses the command line (argv[0] is ddprun itself); DDP_JOB_TOKEN from
/// `env` is the token unless --job_token is given. INVALID_ARGUMENT with a
/// one-line message for unknown flags, malformed values and inconsistent
/// settings (node_rank >= nnodes, several nodes without --master_addr,
/// --nproc_per_node=0, ...).
StatusOr<DdprunOptions> ParseDdprunArgs(int argc, const char* const* argv, const EnvMap& env);

/// The --help text.
std::string DdprunUsage();

/// Runs the launcher of one node: checks the program, binds the store (node
/// 0), meets the other nodes, runs and restarts the workers. Returns the exit
/// status described above; prints one line per failure to stderr.
int RunDdprun(const DdprunOptions& options);

}  // namespace ddp::transport::launch

#endif  // DDP_TRANSPORT_LAUNCH_DDPRUN_H_
