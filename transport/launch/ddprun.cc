#include "transport/launch/ddprun.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include "transport/launch/error_file.h"
#include "transport/launch/self_launch.h"
#include "transport/launch/spawn.h"
#include "transport/store/socket.h"
#include "transport/store/tcp_store.h"

namespace ddp::transport::launch {
namespace {

using namespace std::chrono_literals;
using std::chrono::milliseconds;

constexpr int kMaxNodes = 1 << 16;
// How long one wait on the store lasts before the launcher beats its
// heartbeat and looks around again: at most this, and at most a quarter of
// --node_timeout, so that a live node always beats within the timeout.
constexpr auto kMonitorSlice = 1000ms;
milliseconds MonitorSlice(const DdprunOptions& o) {
  return std::clamp<milliseconds>(o.node_timeout / 4, 10ms, kMonitorSlice);
}
// How long node 0 keeps the store up for the other launchers to read the
// outcome before it exits.
constexpr auto kFarewellTime = 10000ms;
// Node 0's --node_timeout in milliseconds: a launcher given a longer one
// beats (and gives up on an unreachable store) by node 0's.
constexpr char kNodeTimeoutKey[] = "ddprun/node_timeout_ms";
// torchrun's c10d port: for an --rdzv_endpoint given without one (the
// static backend refuses that, as torchrun's), and without an endpoint.
constexpr int kDefaultRdzvPort = 29400;

// ---- parsing ----

std::optional<int64_t> ParseInt(std::string_view text) {
  if (text.empty()) return std::nullopt;
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return v;
}

// The longest time a seconds value may give.
constexpr int64_t kMostSeconds = 1000000000;
constexpr milliseconds kMostTime(kMostSeconds * 1000);

// Seconds as digits with an optional fraction ("30", "0.5", ".25", "3."),
// as milliseconds, to the nearest one; a value above zero is at least 1 ms
// (0.0004 is not zero), one above kMostSeconds is kMostTime + 1 ms. No
// sign, spaces, exponent or hex: strtod took "0x10" and "1e2".
std::optional<milliseconds> ParseSeconds(std::string_view text) {
  const size_t dot = text.find('.');
  const std::string_view whole = text.substr(0, dot);
  const std::string_view fraction = dot == std::string_view::npos ? std::string_view() : text.substr(dot + 1);
  auto digits = [](std::string_view part) {
    return std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (whole.size() + fraction.size() == 0 || !digits(whole) || !digits(fraction)) return std::nullopt;
  const size_t first = std::min(whole.find_first_not_of('0'), whole.size());
  if (whole.size() - first > 10) return kMostTime + 1ms;  // beyond the limit below
  int64_t ms = 0;
  for (char c : whole) ms = ms * 10 + (c - '0');
  if (ms > kMostSeconds) return kMostTime + 1ms;
  ms *= 1000;
  int64_t scale = 100;
  for (size_t k = 0; k < fraction.size() && k < 3; ++k, scale /= 10) ms += (fraction[k] - '0') * scale;
  if (fraction.size() > 3 && fraction[3] >= '5') ++ms;
  if (ms == 0 && fraction.find_first_not_of('0') != std::string_view::npos) ms = 1;
  return milliseconds(ms);
}

// A time value, as every one of ddprun's is read: torchrun reads its own
// (--shutdown_timeout, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, --rdzv_conf's
// timeouts) with Python's int(), so an integer as PythonIntDigits takes it
// (" 30\n", "+30", "3_0"); wider than torchrun, digits with a fraction
// (ParseSeconds), with Python's whitespace around them. At most
// kMostSeconds; not negative, nor zero when `positive`. INVALID_ARGUMENT
// otherwise, its message to follow the value's name ("is not a number of
// seconds").
StatusOr<milliseconds> ParseTorchSeconds(std::string_view text, bool positive) {
  std::optional<milliseconds> time;
  if (const std::optional<int64_t> whole = ParsePythonInt(text)) {
    // Saturated beyond int64 (see ParsePythonInt): no overflow here.
    if (*whole >= 0) time = *whole > kMostSeconds ? kMostTime + 1ms : milliseconds(*whole * 1000);
  } else {
    time = ParseSeconds(StripPythonSpace(text));
  }
  if (time && *time > kMostTime) {
    return InvalidArgumentError("is more than " + std::to_string(kMostSeconds) + " seconds");
  }
  if (!time || (positive && time->count() == 0)) {
    return InvalidArgumentError(std::string("is not a") + (positive ? " positive" : "") + " number of seconds");
  }
  return *time;
}

// Python's float() of a decimal string, as torchrun reads --monitor_interval:
// Python's whitespace around it, a sign, digits with single underscores
// between two digits, an optional fraction and exponent ("+0.5", " 5\n",
// "1e-1", "1_0.5"). nullopt for anything else, and for inf and nan, which
// are no number of seconds ("0x10", "1__0", ".", "inf").
std::optional<double> ParsePythonFloat(std::string_view text) {
  text = StripPythonSpace(text);
  std::string plain;  // without the underscores, for strtod
  size_t i = 0;
  auto sign = [&] {
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) plain += text[i++];
  };
  // Takes the digits at i; returns how many.
  auto digits = [&] {
    size_t n = 0;
    while (i < text.size()) {
      const bool next_is_digit = i + 1 < text.size() && text[i + 1] >= '0' && text[i + 1] <= '9';
      if (text[i] >= '0' && text[i] <= '9') {
        plain += text[i++];
        ++n;
      } else if (text[i] == '_' && n > 0 && next_is_digit) {
        ++i;
      } else {
        break;
      }
    }
    return n;
  };
  sign();
  size_t mantissa = digits();
  if (i < text.size() && text[i] == '.') {
    plain += text[i++];
    mantissa += digits();
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    plain += text[i++];
    sign();
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  const double v = std::strtod(plain.c_str(), nullptr);
  if (!std::isfinite(v)) return std::nullopt;  // 1e999
  return v;
}

std::string Flag(std::string_view name, std::string_view value) {
  return "--" + std::string(name) + "=" + std::string(value);
}

}  // namespace

std::string DdprunUsage() {
  return R"(usage: ddprun [flags] [--] PROGRAM [ARGS...]

Starts PROGRAM as the workers of one node of a data-parallel job, with
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, DDP_STORE_ADDR,
DDP_STORE_PORT (the store ddprun serves), DDP_RESTART_COUNT, DDP_JOB_TOKEN,
DDP_RUN_ID (one per run of ddprun) and DDP_STORE_HOST=launcher set for each; MASTER_ADDR and MASTER_PORT (a free port
on node 0) with TORCHELASTIC_USE_AGENT_STORE=False for a PyTorch program's own
env:// rendezvous; and torchrun's GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK,
ROLE_WORLD_SIZE and TORCHELASTIC_RESTART_COUNT, _MAX_RESTARTS and _RUN_ID;
with several workers per node and no OMP_NUM_THREADS set, OMP_NUM_THREADS=1,
and with no TORCH_NCCL_ASYNC_ERROR_HANDLING set, TORCH_NCCL_ASYNC_ERROR_HANDLING=1
(as torchrun). Node 0's launcher serves the rendezvous store.

  --nproc_per_node=N   workers on this node (default 1; each node may give
                       its own); gpu: one per visible
                       GPU, cpu: one per CPU (of the affinity mask, capped
                       by a cgroup CPU quota), auto: gpu if any, else cpu
  --nnodes=N           nodes in the job (default 1); MIN:MAX with c10d: as
                       many as join, at least MIN, formed anew at every
                       restart (elastic)
  --node_rank=R        this node, in [0, nnodes) (default 0)
  --master_addr=ADDR   address of node 0, where the store listens
                       (required with several nodes; default 127.0.0.1;
                       an IPv6 address bare or in brackets: [::1]);
                       static backend only, as torchrun's
  --master_port=PORT   port of the store (default 29500; 0: any free port);
                       static backend only, as torchrun's
  --rdzv_endpoint=HOST[:PORT]
                       torchrun's spelling of --master_addr and --master_port,
                       and, as under torchrun, wins over them, from
                       PET_RDZV_ENDPOINT too (empty: none, as torchrun's
                       default; c10d's default port 29400;
                       the static backend needs the port, as torchrun's;
                       port 0, any free port, on one node only); with c10d
                       and none, localhost:29400; an IPv6 address goes in
                       brackets: [::1]:29500
  --rdzv_backend=B     static (default): every node gives --node_rank;
                       c10d: no --node_rank, the launcher that can listen on
                       the endpoint serves the store and is node 0, the
                       others are numbered in the order they join; every
                       restart takes in the launchers then present
  --rdzv_id=ID         job id; every node must give the same one
  --rdzv_conf=last_call_timeout=SEC,join_timeout=SEC,keep_alive_interval=SEC,
             keep_alive_max_attempt=N,read_timeout=SEC,is_host=BOOL,...
                       last_call_timeout: with --nnodes=MIN:MAX, how long to
                       wait for more nodes once MIN joined (default 30);
                       join_timeout (or timeout) is --rdzv_timeout (give
                       one of them); the keep-alives make --node_timeout
                       interval x attempts (5 s, 3 if not given; give them
                       or --node_timeout); read_timeout: deadline of one
                       call on the store (default 10, at most --node_timeout);
                       is_host (c10d): serve the store (true) or join (false)
                       instead of trying to listen; close_timeout is
                       ignored; the keys of several --rdzv_conf add up
                       (torchrun keeps only the last)
  --standalone         one node on 127.0.0.1 with a free port and a run id
                       of its own (overrides --rdzv_endpoint and --rdzv_id,
                       as under torchrun)
  --max_restarts=K     restart the whole job up to K times after a failure
  --log_dir=DIR        keep this run's files in DIR/<rdzv_id>_<random>/ (a
                       folder of its own per run; printed at start), in
                       torchrun's layout: attempt_K/LOCAL_RANK/error.json
                       (if the worker writes its error there), and with
                       --tee or --redirects each worker's
                       stdout.log and stderr.log beside it; alone, it
                       leaves the output on the terminal, as torchrun's
  --tee[=CODE]         write workers' streams to their log files and to
                       the terminal (torchrun's -t CODE; bare: 3); CODE is
                       0 none, 1 stdout, 2 stderr, 3 both, or per local
                       rank, LOCAL_RANK:CODE,... (e.g. 0:3,1:2; others 0;
                       unlike torchrun's, a rank may have several digits,
                       and one not below --nproc_per_node gets a note
                       where torchrun passes over it silently)
  --redirects=CODE     write those streams to their log files only
                       (torchrun's -r CODE); without --log_dir, --tee and
                       --redirects log into a fresh
                       $TMPDIR/torchelastic_XXXXXX, as torchrun
  --no_prefix          do not start terminal lines with "[rank] " (or with
                       torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE,
                       $rank, $local_rank and $role_name filled in, if set)
  --local_ranks_filter=R[,R...]
                       show only these local ranks' output on the terminal
                       (log files still get every rank's); empty: all
  --job_token=TOKEN    shared secret of the job (better: env DDP_JOB_TOKEN);
                       required with several nodes, generated otherwise
  --rdzv_timeout=SEC   how long to wait for every node to join (default 600,
                       torchrun's join_timeout)
  --node_timeout=SEC   heartbeat silence after which a node is dead (default 30;
                       node 0's counts: a node given a longer one beats by it)
  --grace_period=SEC   between SIGTERM and SIGKILL when stopping (default 30,
                       torchrun's; its --shutdown_timeout, PET_SHUTDOWN_TIMEOUT
                       and TORCH_ELASTIC_SHUTDOWN_TIMEOUT set it too)
  --max_run_time=SEC   stop the workers after this long (default: no limit)
  --exec_timeout=SEC   how long one worker's exec may take (default 60): one
                       not done by then (a file system that does not answer)
                       is killed and the start fails

  --role=NAME          the workers' ROLE_NAME (default: default)
  --virtual_local_rank each worker gets LOCAL_RANK=0 and one device as
                       CUDA_VISIBLE_DEVICES (its local rank's entry there, or
                       its local rank), as torchrun's

SEC is a number of seconds, at most 1000000000: an integer as Python's int()
reads it, as torchrun reads its times (30, +30, 3_0, spaces around), or digits
with a fraction (0.5).
Dashes and underscores in flag names are interchangeable, and any unique start
of a name stands for it (--nproc=4), as in torchrun's parser; a flag given
twice takes its last value there and here (but --rdzv_conf). As under torchrun,
a torchrun flag missing from the command line is taken from PET_<FLAG> in the
environment (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...); an empty one
counts as unset, where torchrun takes the empty value (and fails on an empty
switch such as PET_STANDALONE, int('')). torchrun's
--no_python is accepted (ddprun always runs PROGRAM itself); for Python,
give the interpreter as PROGRAM: ddprun ... python3 train.py. Also accepted:
--monitor_interval=S (any float() >= 0; ddprun sees a worker exit at once),
--start_method=spawn|fork|forkserver (ddprun always starts a fresh process
with exec, so all three are the same), and, with a note that they are
ignored, --local_addr, --logs_specs, --numa_binding (node, socket, exclusive
or core-complex: ddprun leaves placement to the workers), --event_log_handler,
--signals_to_handle (ddprun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT and stops the job, and
passes SIGUSR1 and SIGUSR2 on without stopping it) and --node_rank with c10d
or --standalone (as torchrun). ARGS may use torchrun's ${local_rank}, replaced by each
worker's LOCAL_RANK. Run in the foreground of a terminal (its stdin), ddprun
hands the terminal to the workers while they run, so that they may read it
(pdb, input()); Ctrl-C there stops the job, Ctrl-Z stops it as a shell job.
)";
}

namespace {

// torchrun's -t/--tee or -r/--redirects value `text` of flag `name`: a
// stream code, 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every
// local rank, or LOCAL_RANK:CODE,... (the ranks not named get 0; a rank
// named twice, the last code, as torchrun's dict).
StatusOr<StreamCodes> ParseStreamCodes(std::string_view name, const std::string& text) {
  auto code_of = [](std::string_view c) -> std::optional<int> {
    if (c.size() == 1 && c[0] >= '0' && c[0] <= '3') return c[0] - '0';
    return std::nullopt;
  };
  auto bad = [&](const std::string& item) {
    return InvalidArgumentError(Flag(name, text) + ": '" + item +
                                "' is not one of torchrun's stream codes 0 (none), 1 (stdout), 2 (stderr), "
                                "3 (both), nor LOCAL_RANK:CODE,... (e.g. 0:3,1:2)");
  };
  StreamCodes codes;
  if (text.find(':') == std::string::npos) {
    const std::optional<int> code = code_of(text);
    if (!code) return bad(text);
    codes.all = *code;
    return codes;
  }
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t colon = item.find(':');
    const std::optional<int64_t> rank =
        colon == std::string::npos ? std::nullopt : ParseInt(std::string_view(item).substr(0, colon));
    const std::optional<int> code =
        colon == std::string::npos ? std::nullopt : code_of(std::string_view(item).substr(colon + 1));
    if (!rank || *rank < 0 || *rank >= 1000000 || !code) return bad(item);
    codes.by_rank[static_cast<int>(*rank)] = *code;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return codes;
}

// "HOST", "HOST:PORT", "[IPV6]" or "[IPV6]:PORT", with Python's whitespace
// around it (torchrun strips it); port -1 when not given. Port 0 (any free
// port, torchrun's `localhost:0` for one node) is refused with several
// nodes by the caller, and an empty endpoint is no endpoint there.
StatusOr<std::pair<std::string, int>> ParseEndpoint(const std::string& given) {
  auto bad = [&](const std::string& why) {
    return InvalidArgumentError(Flag("rdzv_endpoint", given) + ": " + why);
  };
  const std::string text(StripPythonSpace(given));
  std::string host = text;
  std::string port_text;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos) return bad("no ']' after the IPv6 address");
    host = text.substr(1, close - 1);
    const std::string rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') return bad("expected ':PORT' after ']'");
      port_text = rest.substr(1);
      if (port_text.empty()) return bad("empty port");
    }
  } else if (const size_t colon = text.find(':'); colon != std::string::npos) {
    if (text.find(':', colon + 1) != std::string::npos) {
      return bad("an IPv6 address needs brackets: [ADDRESS]:PORT");
    }
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (port_text.empty()) return bad("empty port");
  }
  if (host.empty()) return bad("no host");
  int port = -1;
  if (!port_text.empty()) {
    // Digits only, as torchrun's endpoint parser takes them (no sign,
    // spaces or underscores, unlike its integer flags).
    if (port_text.find_first_not_of("0123456789") != std::string::npos) {
      return bad("'" + port_text + "' is not a port number (digits, 0 to 65535)");
    }
    const std::optional<int64_t> v = ParseInt(port_text);
    if (!v || *v > 65535) return bad("the port must be in [0, 65535]");
    port = static_cast<int>(*v);
  }
  return std::make_pair(host, port);
}

// torchrun's flags, which take their default from PET_<FLAG> (torchrun's
// `env` action: the name upper-cased) when not on the command line. The
// switches (torchrun's `check_env`) take an integer, 0 for off (see
// ParseSwitchValue). ddprun's own flags (--rdzv_timeout, --grace_period,
// ...) have no such variable.
struct PetFlag {
  const char* name;
  bool is_switch;
};

// A PET_ switch's value read as torchrun's check_env reads it,
// bool(int(value)) (see PythonIntDigits in env.h: "1", "2", "-1", "007", "1_0",
// " 1\n"); any nonzero value is on. Returns whether the switch is on;
// nullopt for anything int() refuses ("yes", "true", "1.0", "0x1"), which
// torchrun fails on.
std::optional<bool> ParseSwitchValue(std::string_view text) {
  const std::optional<std::string> digits = PythonIntDigits(text);
  if (!digits) return std::nullopt;
  return digits->find_first_not_of("-0") != std::string::npos;
}
constexpr PetFlag kPetFlags[] = {
    {"nproc_per_node", false}, {"nnodes", false},      {"node_rank", false},
    {"master_addr", false},    {"master_port", false}, {"rdzv_endpoint", false},
    {"rdzv_backend", false},   {"rdzv_id", false},     {"rdzv_conf", false},
    {"standalone", true},      {"max_restarts", false}, {"monitor_interval", false},
    {"start_method", false},   {"role", false},        {"log_dir", false},
    {"redirects", false},      {"tee", false},         {"local_ranks_filter", false},
    {"local_addr", false},     {"no_python", true},
    {"module", true},          {"run_path", true},     {"event_log_handler", false},
    {"signals_to_handle", false}, {"shutdown_timeout", false}, {"virtual_local_rank", true},
    {"duplicate_stdout_filters", false}, {"duplicate_stderr_filters", false},
};

// ddprun's own flags, and torchrun's that have no `env` action
// (--logs_specs, --numa_binding): no PET_ variable sets them.
constexpr const char* kOwnFlags[] = {"no_prefix",    "job_token",    "rdzv_timeout", "node_timeout",
                                     "grace_period", "max_run_time", "logs_specs",   "numa_binding",
                                     "exec_timeout"};

// argparse, torchrun's parser, takes any unique start of a long flag's name
// (`--nproc=4`, `--max_restart 3`, `--standalon`, `--he` for --help); so
// does ddprun, among its own flags, torchrun's and --help. Returns the flag `name` (dashes as
// underscores) stands for: itself when it is one or starts none (left to
// the caller to refuse); INVALID_ARGUMENT naming them when it starts
// several.
StatusOr<std::string> CompleteFlagName(const std::string& name) {
  if (name.empty()) return name;
  std::vector<std::string_view> flags;
  for (const PetFlag& flag : kPetFlags) flags.push_back(flag.name);
  for (const char* flag : kOwnFlags) flags.push_back(flag);
  flags.push_back("help");
  std::vector<std::string_view> starts;
  for (std::string_view flag : flags) {
    if (flag == name) return name;
    if (flag.substr(0, name.size()) == name) starts.push_back(flag);
  }
  if (starts.empty()) return name;
  if (starts.size() == 1) return std::string(starts[0]);
  std::sort(starts.begin(), starts.end());
  std::string list;
  for (size_t i = 0; i < starts.size(); ++i) {
    list += (i == 0 ? "--" : i + 1 < starts.size() ? ", --" : " and --") + std::string(starts[i]);
  }
  return InvalidArgumentError("--" + name + " is ambiguous: it starts " + list +
                              " (give more of the name; see ddprun --help)");
}

using FlagNames = std::set<std::string, std::less<>>;

// torchrun's variable for `flag`: "PET_" and the name upper-cased.
std::string PetVariable(std::string_view flag) {
  std::string name = "PET_";
  for (char c : flag) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// Hands `parse` one "--flag=VALUE" (or "--switch") for each PET_ variable of
// `env` whose flag is not in `given`, and notes each variable used in
// `used` ("PET_NNODES='4'"). An empty variable counts as unset. As under
// torchrun, an endpoint (a non-blank --rdzv_endpoint, `endpoint_given`,
// or PET_RDZV_ENDPOINT) is used over PET_MASTER_ADDR and PET_MASTER_PORT,
// and --standalone over all three; an empty --rdzv_endpoint holds back
// PET_RDZV_ENDPOINT only. (--master_addr and --master_port on the command
// line do not hold back PET_RDZV_ENDPOINT either: torchrun's variable is
// the default of its --rdzv_endpoint, which get_rdzv_endpoint prefers to
// them; the caller notes them as ignored.) A bad value is refused naming
// the variable.
Status ApplyPetDefaults(const EnvMap& env, const FlagNames& given, bool endpoint_given,
                        std::vector<std::string>& used, const std::function<Status(const std::string&)>& parse) {
  auto value_of = [&](std::string_view flag) -> std::string {
    auto it = env.find(PetVariable(flag));
    return it == env.end() ? "" : it->second;
  };
  const bool standalone =
      given.count("standalone") > 0 || ParseSwitchValue(value_of("standalone")).value_or(false);
  const bool endpoint_from_env =
      !standalone && !StripPythonSpace(value_of("rdzv_endpoint")).empty() && given.count("rdzv_endpoint") == 0;
  for (const PetFlag& flag : kPetFlags) {
    const std::string name = flag.name;
    const std::string value = value_of(name);
    if (value.empty() || given.count(name) > 0) continue;
    if (name == "rdzv_endpoint" && !endpoint_from_env) continue;
    if ((name == "master_addr" || name == "master_port") &&
        (standalone || endpoint_from_env || endpoint_given)) {
      continue;
    }
    const std::string shown = PetVariable(name) + "='" + value + "'";
    std::string arg = "--" + name + "=" + value;
    if (flag.is_switch) {
      const std::optional<bool> on = ParseSwitchValue(value);
      if (!on) {
        return InvalidArgumentError(shown + " (from the environment): expected an integer, as torchrun "
                                            "reads it (0: off, any other: on)");
      }
      if (!*on) continue;
      arg = "--" + name;
    }
    used.push_back(shown);
    if (Status s = parse(arg); !s.ok()) {
      return Status(s.code(), shown + " (from the environment): " + s.message());
    }
  }
  return Status::Ok();
}

// ParseDdprunArgs, noting in `from_env` the PET_ variables it used.
StatusOr<DdprunOptions> ParseWithPetDefaults(int argc, const char* const* argv, const EnvMap& env,
                                             std::vector<std::string>& from_env) {
  DdprunOptions o;
  bool port_given = false;
  bool addr_given = false;
  // How each was given, for the notes: the flag, or torchrun's variable.
  std::string port_name = "--master_port", addr_name = "--master_addr";
  bool endpoint_given = false;
  // The endpoint as given ("--rdzv_endpoint=h:1" or "PET_RDZV_ENDPOINT='h:1'"),
  // and what it names (port -1: none given).
  std::string endpoint_text;
  std::string endpoint_addr;
  int endpoint_port = -1;
  bool node_rank_given = false;
  std::string node_rank_name = "--node_rank";  // or PET_NODE_RANK, for the notes
  bool node_timeout_given = false;
  // --rdzv_timeout, and --rdzv_conf's key for the same wait (join_timeout
  // or timeout) with its value, if given.
  bool rdzv_timeout_given = false;
  bool rdzv_timeout_on_command_line = false;
  std::string join_timeout_key;
  bool join_timeout_on_command_line = false;
  std::optional<milliseconds> conf_join_timeout;
  // The flag that made each of o.notes while the flags are read: a flag
  // given again replaces its earlier value (argparse's last one wins), and
  // with it the notes that value made. Not --rdzv_conf, whose keys add up
  // over several flags (see RdzvConfFlagsAddUp in the tests).
  std::vector<std::string> note_makers;
  // --rdzv_conf keep_alive_interval and keep_alive_max_attempt, if given.
  std::optional<milliseconds> keep_alive_interval;
  std::optional<int> keep_alive_attempts;
  bool token_given = false;
  // --grace_period or torchrun's --shutdown_timeout (or PET_SHUTDOWN_TIMEOUT)
  // was given: TORCH_ELASTIC_SHUTDOWN_TIMEOUT then does not count.
  bool grace_given = false;
  bool virtual_local_rank = false;
  // The flags on the command line, by name (dashes as underscores): a
  // PET_ variable stands in only for the others.
  FlagNames given;
  // The flags a PET_ variable set: a note names the variable, not the flag.
  FlagNames from_variable;
  // "--local_addr=h" or "PET_LOCAL_ADDR='h'"; "--tee" or "PET_TEE".
  auto shown = [&](std::string_view flag, const std::string& value) {
    return from_variable.count(flag) > 0 ? PetVariable(flag) + "='" + value + "'" : Flag(flag, value);
  };
  auto named = [&](std::string_view flag) {
    return from_variable.count(flag) > 0 ? PetVariable(flag) : "--" + std::string(flag);
  };
  // Reads the flags in argv[1..argc) up to the program; returns where the
  // program starts, or -1 for --help.
  auto parse_flags = [&](int argc, const char* const* argv, bool on_command_line) -> StatusOr<int> {
    int i = 1;
    for (; i < argc; ++i) {
      std::string_view arg(argv[i]);
      if (arg == "--") {
        ++i;
        break;
      }
      if (arg == "-h") {
        o.help = true;
        return -1;
      }
      if (arg == "-m") {
        return InvalidArgumentError(
            "-m runs a Python module under torchrun; ddprun starts programs: give the program "
            "(e.g. python3 -m MODULE)");
      }
      if (arg.size() < 2 || arg[0] != '-') break;  // the program
      std::string name;
      std::optional<std::string> value;
      if (arg[1] != '-') {
        // torchrun's short forms: -t CODE (--tee) and -r CODE (--redirects),
        // also -t3 and -t=3. Any other "-X" before the program is a flag
        // ddprun does not know, not a program (that would go after --).
        if (arg[1] != 't' && arg[1] != 'r') {
          return InvalidArgumentError("unknown flag " + std::string(arg) +
                                      " (ddprun's short flags are torchrun's -t for --tee and -r for "
                                      "--redirects; see ddprun --help)");
        }
        name = arg[1] == 't' ? "tee" : "redirects";
        if (arg.size() > 2) value = std::string(arg.substr(arg[2] == '=' ? 3 : 2));
      } else {
        name = std::string(arg.substr(2));
        if (const size_t eq = name.find('='); eq != std::string::npos) {
          value = name.substr(eq + 1);
          name.resize(eq);
        }
        for (char& c : name) c = c == '-' ? '_' : c;
        DDP_ASSIGN_OR_RETURN(name, CompleteFlagName(name));
      }
      if (name == "help") {
        if (value) return InvalidArgumentError("--help takes no value");
        o.help = true;
        return -1;
      }
      if (on_command_line) {
        given.insert(name);
        // The same setting: PET_SHUTDOWN_TIMEOUT must not override it.
        if (name == "grace_period") given.insert("shutdown_timeout");
      } else {
        from_variable.insert(name);
      }
      for (size_t n = note_makers.size(); n-- > 0 && name != "rdzv_conf";) {
        if (note_makers[n] != name) continue;
        o.notes.erase(o.notes.begin() + static_cast<std::ptrdiff_t>(n));
        note_makers.erase(note_makers.begin() + static_cast<std::ptrdiff_t>(n));
      }

      auto take_value = [&]() -> StatusOr<std::string> {
        if (value) return *value;
        if (i + 1 >= argc) return InvalidArgumentError("--" + name + " needs a value");
        // `--log_dir --tee`: a value left out, not a folder named --tee.
        if (std::string_view(argv[i + 1]).rfind("--", 0) == 0) {
          return InvalidArgumentError("--" + name + " needs a value, not the flag '" + argv[i + 1] +
                                      "' after it (a value that starts with -- is given as --" + name +
                                      "=VALUE)");
        }
        return std::string(argv[++i]);
      };
      auto take_int = [&](int64_t lo, int64_t hi, int& out) -> Status {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        std::optional<int64_t> v = ParsePythonInt(text);
        if (!v) return InvalidArgumentError(Flag(name, text) + " is not an integer");
        if (*v < lo || *v > hi) {
          return InvalidArgumentError(Flag(name, text) + " must be in [" + std::to_string(lo) +
                                      ", " + std::to_string(hi) + "]");
        }
        out = static_cast<int>(*v);
        return Status::Ok();
      };
      auto take_seconds = [&](milliseconds& out, bool positive) -> Status {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        StatusOr<milliseconds> v = ParseTorchSeconds(text, positive);
        if (!v.ok()) return InvalidArgumentError(Flag(name, text) + " " + v.status().message());
        out = *v;
        return Status::Ok();
      };
      auto no_value = [&]() -> Status {
        if (value) return InvalidArgumentError("--" + name + " takes no value");
        return Status::Ok();
      };

      if (name == "nproc_per_node") {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        DDP_ASSIGN_OR_RETURN(o.nproc_per_node, ParseNprocPerNode(text, env));
      } else if (name == "nnodes") {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        o.min_nodes = 0;
        if (const size_t colon = text.find(':'); colon != std::string::npos) {
          const std::optional<int64_t> lo = ParsePythonInt(std::string_view(text).substr(0, colon));
          const std::optional<int64_t> hi = ParsePythonInt(std::string_view(text).substr(colon + 1));
          if (!lo || !hi || *lo < 1 || *hi < *lo || *hi > kMaxNodes) {
            return InvalidArgumentError(Flag(name, text) + ": expected MIN:MAX with 1 <= MIN <= MAX <= " +
                                        std::to_string(kMaxNodes));
          }
          o.nnodes = static_cast<int>(*hi);
          if (*lo < *hi) o.min_nodes = static_cast<int>(*lo);
        } else {
          value = text;
          DDP_RETURN_IF_ERROR(take_int(1, kMaxNodes, o.nnodes));
        }
        // The value, not its spelling, is compared with node 0's: "2",
        // "+2", " 2" and "2:2" are the same fixed count, and a launcher
        // that spelled it otherwise was refused.
        o.nnodes_spec = o.min_nodes > 0 ? std::to_string(o.min_nodes) + ":" + std::to_string(o.nnodes)
                                        : std::to_string(o.nnodes);
      } else if (name == "rdzv_conf") {
        // torchrun's KEY=VALUE,... rendezvous settings. Its keep-alives (a
        // beat every keep_alive_interval, dead after keep_alive_max_attempt
        // missed ones) are --node_timeout; its other keys map to ddprun's
        // settings where they mean the same, and are noted as ignored where
        // nothing here matches.
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        auto bad_item = [&](const std::string& item, const std::string& why) {
          return InvalidArgumentError(Flag(name, text) + ": '" + item + "': " + why);
        };
        // For a note: "--rdzv_conf=use_libuv=0", or "use_libuv=0 in PET_RDZV_CONF".
        auto conf_item = [&](const std::string& item) {
          return on_command_line ? Flag(name, item) : item + " in " + PetVariable(name);
        };
        size_t start = 0;
        while (start < text.size()) {
          size_t end = text.find(',', start);
          if (end == std::string::npos) end = text.size();
          const std::string item = text.substr(start, end - start);
          start = end + 1;
          // As torchrun, spaces around a key and its value do not count
          // ("join_timeout=900, last_call_timeout=60").
          auto trimmed = [](std::string text) {
            text.erase(0, text.find_first_not_of(" \t"));
            text.erase(text.find_last_not_of(" \t") + 1);
            return text;
          };
          const size_t eq = item.find('=');
          const std::string key = trimmed(item.substr(0, eq));
          const std::string raw = eq == std::string::npos ? "" : trimmed(item.substr(eq + 1));
          // The value of a time key, as torchrun's int() (see
          // ParseTorchSeconds); refused naming the item and the key.
          auto seconds = [&](bool positive) -> StatusOr<milliseconds> {
            StatusOr<milliseconds> v = ParseTorchSeconds(raw, positive);
            if (!v.ok()) return bad_item(item, key + " " + v.status().message());
            return v;
          };
          if (key == "keep_alive_max_attempt") {
            // torchrun's get_as_int: int() ("+4", "1_0").
            const std::optional<int64_t> attempts = ParsePythonInt(raw);
            if (!attempts || *attempts < 1 || *attempts > 1000) {
              return bad_item(item, "keep_alive_max_attempt takes a count from 1 to 1000");
            }
            keep_alive_attempts = static_cast<int>(*attempts);
          } else if (key == "is_host") {
            // c10d: whether this launcher serves the store, instead of
            // finding out by trying to listen on the endpoint.
            std::string lower = raw;
            for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            if (lower == "1" || lower == "true" || lower == "t" || lower == "yes" || lower == "y") {
              o.is_host = true;
            } else if (lower == "0" || lower == "false" || lower == "f" || lower == "no" || lower == "n") {
              o.is_host = false;
            } else {
              return bad_item(item, "is_host takes true or false (1/0, yes/no)");
            }
          } else if (key == "last_call_timeout") {
            DDP_ASSIGN_OR_RETURN(o.last_call, seconds(/*positive=*/false));
          } else if (key == "join_timeout" || key == "timeout") {
            // timeout: the static and etcd backends' name for the same wait.
            DDP_ASSIGN_OR_RETURN(conf_join_timeout, seconds(/*positive=*/true));
            join_timeout_key = key;
            join_timeout_on_command_line = on_command_line;
          } else if (key == "keep_alive_interval") {
            DDP_ASSIGN_OR_RETURN(keep_alive_interval, seconds(/*positive=*/true));
          } else if (key == "read_timeout") {
            // torchrun's deadline of one call on the store.
            DDP_ASSIGN_OR_RETURN(o.store_call_time, seconds(/*positive=*/true));
          } else if (key == "use_libuv" || key == "store_connect_wait_seconds") {
            // Settings of PyTorch's own TCPStore, which ddprun does not use.
            std::string lower = raw;
            for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            if (key == "use_libuv" && lower != "1" && lower != "true" && lower != "t" && lower != "yes" &&
                lower != "y" && lower != "0" && lower != "false" && lower != "f" && lower != "no" &&
                lower != "n") {
              return bad_item(item, "use_libuv takes true or false (1/0, yes/no)");
            }
            if (key == "store_connect_wait_seconds" && ParsePythonInt(raw).value_or(-1) < 0) {
              return bad_item(item, "store_connect_wait_seconds takes a whole number of seconds");
            }
            o.notes.push_back(conf_item(item) +
                              " is ignored: it sets PyTorch's TCPStore, and ddprun's launchers meet in "
                              "a store of their own");
          } else if (key == "close_timeout") {
            DDP_RETURN_IF_ERROR(seconds(/*positive=*/true).status());
            o.notes.push_back(conf_item(item) +
                              " is ignored: when the job ends, node 0 tells the waiting launchers "
                              "and keeps the store up for them for up to 10 s");
          } else {
            return bad_item(item,
                            "not one of last_call_timeout, join_timeout (or timeout), read_timeout, "
                            "close_timeout, keep_alive_interval (SEC), keep_alive_max_attempt=N, "
                            "is_host=BOOL, use_libuv=BOOL, store_connect_wait_seconds=N");
          }
        }
      } else if (name == "node_rank") {
        DDP_RETURN_IF_ERROR(take_int(0, kMaxNodes, o.node_rank));
        node_rank_given = true;
        node_rank_name = on_command_line ? "--node_rank" : "PET_NODE_RANK";
      } else if (name == "monitor_interval") {
        // torchrun looks at its workers every so often; ddprun learns of a
        // worker's exit at once (pidfd), so there is nothing to set. Any
        // finite number of seconds >= 0 is taken, as torchrun's float().
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        const std::optional<double> interval = ParsePythonFloat(text);
        if (!interval || *interval < 0) return InvalidArgumentError(Flag(name, text) + " is not a number of seconds");
      } else if (name == "start_method") {
        // Python's ways of starting a worker; ddprun starts every worker with
        // vfork + exec, a fresh process image, so they all come to the same.
        DDP_ASSIGN_OR_RETURN(std::string method, take_value());
        if (method != "spawn" && method != "fork" && method != "forkserver") {
          return InvalidArgumentError(Flag(name, method) + ": expected spawn, fork or forkserver");
        }
      } else if (name == "role") {
        DDP_ASSIGN_OR_RETURN(o.role, take_value());
        if (o.role.empty() || o.role.find_first_of(" \t\n=") != std::string::npos) {
          return InvalidArgumentError(Flag(name, o.role) + " must be non-empty without spaces or '='");
        }
      } else if (name == "local_addr") {
        DDP_ASSIGN_OR_RETURN(std::string addr, take_value());
        o.notes.push_back(shown(name, addr) +
                          " is ignored: launchers other than node 0 need no address of their own "
                          "(they connect to node 0's store)");
      } else if (name == "event_log_handler") {
        DDP_ASSIGN_OR_RETURN(std::string handler, take_value());
        if (handler != "null") {
          o.notes.push_back(shown(name, handler) +
                            " is ignored: ddprun records no torchelastic events (its lines on stderr "
                            "and the error files say what happened)");
        }
      } else if (name == "signals_to_handle") {
        // torchrun's list of the signals its agent catches, forwards to the
        // workers and then stops the job on. ddprun's set is fixed.
        DDP_ASSIGN_OR_RETURN(std::string list, take_value());
        static constexpr std::string_view kKnown[] = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT",
                                                      "SIGUSR1", "SIGUSR2"};
        size_t start = 0;
        bool usr = false;
        std::set<std::string, std::less<>> listed;
        while (true) {
          const size_t comma = list.find(',', start);
          std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
          item.erase(0, item.find_first_not_of(" \t"));
          item.erase(item.find_last_not_of(" \t") + 1);
          if (std::find(std::begin(kKnown), std::end(kKnown), item) == std::end(kKnown)) {
            return InvalidArgumentError(Flag(name, list) + ": '" + item +
                                        "' is not one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 "
                                        "(the signals ddprun passes on to the workers)");
          }
          usr = usr || item == "SIGUSR1" || item == "SIGUSR2";
          listed.insert(item);
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
        // torchrun's default is what ddprun does anyway: nothing to say.
        if (listed != std::set<std::string, std::less<>>{"SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM"}) {
          o.notes.push_back(shown(name, list) +
                          " is ignored: ddprun always forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to "
                          "the workers and stops the job" +
                          (usr ? ", and passes SIGUSR1 and SIGUSR2 on to them without stopping it" : ""));
        }
      } else if (name == "logs_specs") {
        DDP_ASSIGN_OR_RETURN(std::string specs, take_value());
        o.notes.push_back(Flag(name, specs) +
                          " is ignored: ddprun writes torchrun's default layout, --log_dir/<rdzv_id>_<random>/"
                          "attempt_K/LOCAL_RANK/stdout.log, stderr.log and error.json");
      } else if (name == "numa_binding") {
        // torchrun pins each worker's CPUs near its GPU (LOCAL_RANK's);
        // ddprun starts the workers where it runs and leaves placement to
        // them, so the mode is checked and then noted as ignored.
        DDP_ASSIGN_OR_RETURN(std::string mode, take_value());
        if (mode != "node" && mode != "socket" && mode != "exclusive" && mode != "core-complex") {
          return InvalidArgumentError(Flag(name, mode) + ": expected node, socket, exclusive or core-complex");
        }
        o.notes.push_back(Flag(name, mode) +
                          " is ignored: ddprun leaves the workers' CPU and memory placement to them");
      } else if (name == "master_addr") {
        DDP_ASSIGN_OR_RETURN(o.master_addr, take_value());
        if (o.master_addr.empty()) return InvalidArgumentError("--master_addr is empty");
        // torchrun's help spells an IPv6 address in brackets
        // ([0:0:0:0:0:0:0:1]); the address is what is inside.
        if (o.master_addr[0] == '[') {
          const std::string given = o.master_addr;
          const size_t close = given.find(']');
          if (close == std::string::npos) {
            return InvalidArgumentError(Flag(name, given) + ": no ']' after the IPv6 address");
          }
          if (close + 1 != given.size()) {
            return InvalidArgumentError(Flag(name, given) +
                                        ": the port goes in --master_port, not after the ']'");
          }
          if (close == 1) return InvalidArgumentError(Flag(name, given) + ": no address inside the brackets");
          o.master_addr = given.substr(1, close - 1);
        } else if (std::count(o.master_addr.begin(), o.master_addr.end(), ':') == 1) {
          // HOST:PORT: taken for a host name, it failed later as "cannot
          // resolve [HOST:PORT]:PORT", naming no flag.
          return InvalidArgumentError(Flag(name, o.master_addr) +
                                      ": the port goes in --master_port (an IPv6 address, which has two or "
                                      "more ':', may stand bare or in brackets)");
        }
        addr_given = true;
        addr_name = on_command_line ? "--master_addr" : "PET_MASTER_ADDR";
      } else if (name == "master_port") {
        DDP_RETURN_IF_ERROR(take_int(0, 65535, o.master_port));
        port_given = true;
        port_name = on_command_line ? "--master_port" : "PET_MASTER_PORT";
      } else if (name == "rdzv_endpoint") {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        // Empty (or blank), it is none, as torchrun's default "" (a
        // launch line's --rdzv_endpoint="$ENDPOINT" with the variable
        // unset): --master_addr and --master_port, or c10d's default, name
        // the store. It was refused as "no host".
        endpoint_given = !StripPythonSpace(text).empty();
        if (endpoint_given) {
          DDP_ASSIGN_OR_RETURN(auto endpoint, ParseEndpoint(text));
          endpoint_text = on_command_line ? Flag(name, text) : "PET_RDZV_ENDPOINT='" + text + "'";
          endpoint_addr = endpoint.first;
          endpoint_port = endpoint.second;  // -1: none given; the backend decides below
        }
      } else if (name == "rdzv_backend") {
        DDP_ASSIGN_OR_RETURN(o.rdzv_backend, take_value());
        if (o.rdzv_backend != "static" && o.rdzv_backend != "c10d") {
          return InvalidArgumentError(Flag(name, o.rdzv_backend) +
                                      " is not supported; use static or c10d");
        }
      } else if (name == "rdzv_id") {
        DDP_ASSIGN_OR_RETURN(o.rdzv_id, take_value());
        if (o.rdzv_id.empty() || o.rdzv_id.find_first_of(" \t\n") != std::string::npos) {
          return InvalidArgumentError(Flag(name, o.rdzv_id) + " must be non-empty without spaces");
        }
      } else if (name == "standalone") {
        DDP_RETURN_IF_ERROR(no_value());
        o.standalone = true;
      } else if (name == "max_restarts") {
        DDP_RETURN_IF_ERROR(take_int(0, 1000000, o.max_restarts));
      } else if (name == "log_dir") {
        DDP_ASSIGN_OR_RETURN(o.log_dir, take_value());
        if (o.log_dir.empty()) return InvalidArgumentError("--log_dir is empty");
      } else if (name == "tee" || name == "redirects") {
        // torchrun's stream codes (see ParseStreamCodes), as --tee=3 or
        // --tee 3. A bare --tee is --tee=3.
        // The next argument is the value when it looks like one: a code
        // (`--tee 3`) or a per-rank map (`-r 0:3,1:2`), so that a bad value
        // is refused as such instead of being run as the program ('0:4'
        // not found).
        if (name == "tee" && value && value->empty()) {
          return InvalidArgumentError(
              "--tee= is empty: give a code (0 to 3, or LOCAL_RANK:CODE,...), or --tee alone for 3");
        }
        std::string code = value.value_or("");
        if (!value && i + 1 < argc && argv[i + 1][0] != '\0' &&
            std::string_view(argv[i + 1]).find_first_not_of("0123456789:,") == std::string_view::npos) {
          code = argv[++i];
        }
        if (code.empty() && name == "redirects") return InvalidArgumentError("--redirects needs a value");
        StreamCodes& codes = name == "tee" ? o.tee : o.redirects;
        if (code.empty()) {
          codes = StreamCodes{kBothStreams, {}};
        } else {
          DDP_ASSIGN_OR_RETURN(codes, ParseStreamCodes(name, code));
        }
      } else if (name == "local_ranks_filter") {
        DDP_ASSIGN_OR_RETURN(std::string text, take_value());
        o.local_ranks_filter.clear();
        // As torchrun's: an empty value filters nothing.
        size_t start = 0;
        while (!text.empty()) {
          const size_t comma = text.find(',', start);
          std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
          // torchrun reads each with Python's int(): spaces around it, a
          // sign, underscores between digits ("+1", " 2", "1_0").
          item.erase(0, item.find_first_not_of(" \t"));
          item.erase(item.find_last_not_of(" \t") + 1);
          const std::optional<int64_t> v = ParsePythonInt(item);
          if (!v || *v < 0 || *v >= 1000000) {
            return InvalidArgumentError(Flag(name, text) + ": '" + item +
                                        "' is not a local rank (a comma-separated list such as 0,1)");
          }
          o.local_ranks_filter.push_back(static_cast<int>(*v));
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
        std::sort(o.local_ranks_filter.begin(), o.local_ranks_filter.end());
        o.local_ranks_filter.erase(std::unique(o.local_ranks_filter.begin(), o.local_ranks_filter.end()),
                                   o.local_ranks_filter.end());
      } else if (name == "no_prefix") {
        DDP_RETURN_IF_ERROR(no_value());
        o.prefix = false;
      } else if (name == "job_token") {
        DDP_ASSIGN_OR_RETURN(o.job_token, take_value());
        token_given = true;
      } else if (name == "duplicate_stdout_filters" || name == "duplicate_stderr_filters") {
        // torchrun copies the lines of one stream that match a filter to a
        // file of their own; ddprun makes no such file: refused, rather
        // than the copy silently missing.
        DDP_ASSIGN_OR_RETURN(std::string filters, take_value());
        return InvalidArgumentError(Flag(name, filters) +
                                    " is not supported: ddprun copies no matching lines to a file of their "
                                    "own (a worker's output goes to the terminal and, with --tee or --redirects, "
                                    "to its stdout.log and stderr.log, which grep can filter)");
      } else if (name == "virtual_local_rank") {
        DDP_RETURN_IF_ERROR(no_value());
        virtual_local_rank = true;
      } else if (name == "no_python") {
        // torchrun's way of saying "PROGRAM is not a Python script": ddprun
        // always runs PROGRAM itself.
        DDP_RETURN_IF_ERROR(no_value());
      } else if (name == "module") {
        return InvalidArgumentError(
            "--module is torchrun's way of running Python; ddprun starts programs: give the program "
            "(e.g. python3 -m MODULE)");
      } else if (name == "run_path") {
        // torchrun runs the script in its own interpreter (runpy); here
        // every worker is a process of its own, so the interpreter runs it.
        return InvalidArgumentError(
            "--run_path runs a Python script inside torchrun's own interpreter; ddprun starts programs: "
            "give the interpreter and the script (e.g. python3 /abs/path/script.py)");
      } else if (name == "rdzv_timeout") {
        DDP_RETURN_IF_ERROR(take_seconds(o.rdzv_timeout, /*positive=*/true));
        rdzv_timeout_given = true;
        rdzv_timeout_on_command_line = on_command_line;
      } else if (name == "node_timeout") {
        DDP_RETURN_IF_ERROR(take_seconds(o.node_timeout, /*positive=*/true));
        node_timeout_given = true;
      } else if (name == "grace_period" || name == "shutdown_timeout") {
        // torchrun's --shutdown_timeout (torch 2.12 on) is the same wait
        // between SIGTERM and SIGKILL.
        DDP_RETURN_IF_ERROR(take_seconds(o.grace, /*positive=*/false));
        grace_given = true;
      } else if (name == "max_run_time") {
        DDP_RETURN_IF_ERROR(take_seconds(o.max_run_time, /*positive=*/false));
      } else if (name == "exec_timeout") {
        DDP_RETURN_IF_ERROR(take_seconds(o.exec_timeout, /*positive=*/true));
      } else {
        return InvalidArgumentError("unknown flag --" + name + " (see ddprun --help)");
      }
      note_makers.resize(o.notes.size(), name);
    }
    return i;
  };
  DDP_ASSIGN_OR_RETURN(const int program_at, parse_flags(argc, argv, /*on_command_line=*/true));
  if (program_at < 0) return o;
  DDP_RETURN_IF_ERROR(ApplyPetDefaults(env, given, endpoint_given, from_env, [&](const std::string& flag) {
    const char* const args[] = {"ddprun", flag.c_str()};
    return parse_flags(2, args, /*on_command_line=*/false).status();
  }));
  for (int i = program_at; i < argc; ++i) o.command.emplace_back(argv[i]);

  if (o.command.empty()) {
    return InvalidArgumentError("no program given: ddprun [flags] [--] PROGRAM [ARGS...]");
  }
  // "--master_addr is", "PET_MASTER_PORT is", "... and ... are": what a
  // note says is ignored.
  const auto ignored_masters = [&] {
    return addr_given && port_given ? addr_name + " and " + port_name + " are"
                                    : (addr_given ? addr_name : port_name) + " is";
  };
  // torchrun's precedence: --standalone replaces the endpoint (and logs
  // it), and an endpoint, from the command line or PET_RDZV_ENDPOINT, wins
  // over --master_addr and --master_port (get_rdzv_endpoint reads them only
  // when no endpoint is given). A note on what --standalone overrides
  // names PET_STANDALONE when that set it, as the command line then says
  // nothing of --standalone.
  if (o.standalone) {
    const std::string why = " ignored: " + named("standalone") + " runs the store on 127.0.0.1 with a free port";
    if (endpoint_given) o.notes.push_back(endpoint_text + " is" + why);
    if (addr_given || port_given) o.notes.push_back(ignored_masters() + why);
  } else if (endpoint_given) {
    // torchrun's static backend refuses an endpoint without a port ("port
    // is missing in endpoint"); c10d's default port is 29400. Falling back
    // to 29400 here had a node meet at a port nobody asked for.
    if (endpoint_port < 0 && o.rdzv_backend != "c10d") {
      return InvalidArgumentError(endpoint_text + ": the port is missing; with --rdzv_backend=" +
                                  o.rdzv_backend + " give HOST:PORT (or --master_addr and --master_port "
                                  "instead of an endpoint), as torchrun requires");
    }
    if (addr_given || port_given) {
      o.notes.push_back(ignored_masters() + " ignored: " + endpoint_text + " names the store, as under torchrun");
    }
    o.master_addr = endpoint_addr;
    o.master_port = endpoint_port >= 0 ? endpoint_port : kDefaultRdzvPort;
  } else if (o.rdzv_backend == "c10d" && !o.standalone) {
    // torchrun reads --master_addr and --master_port for the static backend
    // only (get_rdzv_endpoint); c10d's empty endpoint is localhost on its
    // default port. Launchers that followed torchrun's defaults on one host
    // met at 29400 there and missed ddprun's 127.0.0.1:29500.
    if (addr_given || port_given) {
      o.notes.push_back(ignored_masters() + " ignored with --rdzv_backend=c10d, as under torchrun: give the store as "
                        "--rdzv_endpoint=HOST:PORT (without one it is at localhost:" +
                        std::to_string(kDefaultRdzvPort) + ")");
    }
    o.master_addr = "localhost";
    o.master_port = kDefaultRdzvPort;
  }
  // torchrun's --standalone replaces --rdzv_id too, with a run id of its
  // own (a uuid4) for every run; here the run's DDP_RUN_ID, made in RunJob.
  if (o.standalone && !o.rdzv_id.empty()) {
    o.notes.push_back(shown("rdzv_id", o.rdzv_id) + " is ignored: " + named("standalone") +
                      " makes up a run id for each run, as torchrun's does");
    o.rdzv_id.clear();
  }
  // Before the range check: --standalone with --nnodes=1:2 wants one node
  // too, and --rdzv_backend=c10d would not help it.
  if (o.standalone && o.nnodes > 1) {
    return InvalidArgumentError("--standalone runs one node; it cannot be combined with --nnodes=" +
                                (o.nnodes_spec.empty() ? std::to_string(o.nnodes) : o.nnodes_spec));
  }
  // torchrun's --standalone is c10d on one node, which ignores --node_rank.
  if (o.standalone && o.node_rank != 0) {
    o.notes.push_back(node_rank_name + "=" + std::to_string(o.node_rank) + " is ignored with " +
                      named("standalone") + ": it runs one node, node 0");
    o.node_rank = 0;
  }
  if (o.min_nodes > 0 && o.rdzv_backend != "c10d") {
    return InvalidArgumentError("--nnodes=" + o.nnodes_spec +
                                ": a range of nodes needs --rdzv_backend=c10d (nodes numbered as "
                                "they join)");
  }
  if (o.rdzv_backend == "c10d") {
    if (node_rank_given) {
      // As under torchrun, which hands --node_rank to the static backend only.
      o.notes.push_back(node_rank_name + "=" + std::to_string(o.node_rank) +
                        " is ignored with --rdzv_backend=c10d: nodes are numbered as they join");
      o.node_rank = 0;
    }
    o.assign_node_rank = o.nnodes > 1;
    // Every launcher could listen on a wildcard address, and each would
    // then serve a store of its own.
    static constexpr std::string_view kWildcards[] = {"0.0.0.0", "0", "::", "::0", "0:0:0:0:0:0:0:0"};
    if (o.assign_node_rank &&
        std::find(std::begin(kWildcards), std::end(kWildcards), o.master_addr) != std::end(kWildcards)) {
      return InvalidArgumentError("the store's address " + o.master_addr +
                                  " is a wildcard address; with --rdzv_backend=c10d it must be "
                                  "the address of one node, which then serves the store");
    }
  }
  if (o.is_host && !o.assign_node_rank) {
    o.notes.push_back(named("rdzv_conf") + " is_host=" + (*o.is_host ? "true" : "false") +
                      " is ignored: " +
                      (o.rdzv_backend == "c10d" ? "one node serves its own store"
                                                : "with --rdzv_backend=static node 0 serves the store"));
    o.is_host.reset();
  }
  // Both on the command line (or both from the environment): refused, as
  // the keep-alives with --node_timeout below (letting one win depended on
  // their order). One on the command line and one from the environment:
  // the command line wins, as for every torchrun setting, with a note.
  if (rdzv_timeout_given && !join_timeout_key.empty()) {
    if (rdzv_timeout_on_command_line == join_timeout_on_command_line) {
      return InvalidArgumentError("--rdzv_timeout and --rdzv_conf's " + join_timeout_key +
                                  " both say how long to wait for every node to join; give one of them");
    }
    if (rdzv_timeout_on_command_line) {
      o.notes.push_back(join_timeout_key + " in " + PetVariable("rdzv_conf") +
                        " is overridden by --rdzv_timeout on the command line");
      conf_join_timeout.reset();
    } else {
      o.notes.push_back(PetVariable("rdzv_timeout") + " is overridden by --rdzv_conf's " + join_timeout_key +
                        " on the command line");
    }
  }
  if (conf_join_timeout) o.rdzv_timeout = *conf_join_timeout;
  if (keep_alive_interval || keep_alive_attempts) {
    if (node_timeout_given) {
      return InvalidArgumentError(
          "--node_timeout and --rdzv_conf's keep_alive_interval/keep_alive_max_attempt both say when a "
          "silent node is dead; give one of them");
    }
    // torchrun's defaults: a beat every 5 s, dead after 3 missed.
    const milliseconds interval = keep_alive_interval.value_or(milliseconds(5000));
    const int64_t attempts = keep_alive_attempts.value_or(3);
    // Each is bounded, their product is not: past 1e9 s it would overflow
    // the nanoseconds it is compared in, and every node would look dead.
    if (interval.count() > kMostSeconds * 1000 / attempts) {
      return InvalidArgumentError("--rdzv_conf keep_alive_interval x keep_alive_max_attempt (" +
                                  std::to_string(interval.count()) + " ms x " + std::to_string(attempts) +
                                  ") is beyond " + std::to_string(kMostSeconds) + " s");
    }
    o.node_timeout = interval * attempts;
  }
  if (o.node_rank >= o.nnodes) {
    return InvalidArgumentError("--node_rank=" + std::to_string(o.node_rank) +
                                " is not below --nnodes=" + std::to_string(o.nnodes));
  }
  if (o.standalone) {
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }
  if (o.nnodes > 1) {
    if (o.master_addr.empty()) {
      return InvalidArgumentError("--master_addr (or --rdzv_endpoint) is required with --nnodes=" +
                                  std::to_string(o.nnodes) +
                                  " (the address of node 0, where the store listens)");
    }
    if (o.master_port == 0) {
      return InvalidArgumentError(
          std::string(endpoint_given ? "port 0 in --rdzv_endpoint" : "--master_port=0") +
          " (any free port) works on one node only (--nnodes=1): every node must know the port");
    }
  }
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
  // torchrun's launcher takes its shutdown timeout from
  // TORCH_ELASTIC_SHUTDOWN_TIMEOUT when no flag gives it: a job that saves
  // a checkpoint on SIGTERM sets it to the time the save takes (this
  // variable was ignored, and the save killed after the default grace).
  if (auto it = env.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); !grace_given && it != env.end() && !it->second.empty()) {
    const StatusOr<milliseconds> v = ParseTorchSeconds(it->second, /*positive=*/false);
    if (!v.ok()) {
      return InvalidArgumentError("TORCH_ELASTIC_SHUTDOWN_TIMEOUT='" + it->second + "' (from the environment) " +
                                  v.status().message());
    }
    o.grace = *v;
  }
  if (!token_given) {
    if (auto it = env.find(kEnvJobToken); it != env.end()) o.job_token = it->second;
  }
  if (auto it = env.find(kEnvErrorFile); it != env.end()) {
    o.error_file = it->second;
  }
  if (auto it = env.find("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); it != env.end()) {
    o.line_prefix_template = it->second;
  }
  if (o.job_token.size() > kMaxJobTokenBytes) {
    return InvalidArgumentError("the job token is " + std::to_string(o.job_token.size()) +
                                " bytes long, more than the limit of " +
                                std::to_string(kMaxJobTokenBytes));
  }
  if (o.nnodes > 1 && o.job_token.empty()) {
    return InvalidArgumentError(
        "several nodes need a shared job token: set DDP_JOB_TOKEN (or --job_token) to the same "
        "secret on every node");
  }
  // torchrun's --tee 3 or --redirects 3 without --log_dir (torchtitan's and
  // torchchat's launch lines) log into a temporary folder of their own.
  o.temp_log_dir = o.log_dir.empty() && (o.tee.Any(o.nproc_per_node) || o.redirects.Any(o.nproc_per_node));
  // torchrun passes over the local ranks a map names beyond its workers;
  // so does ddprun, saying so.
  for (const auto* codes : {&o.tee, &o.redirects}) {
    if (!codes->by_rank.empty() && codes->by_rank.rbegin()->first >= o.nproc_per_node) {
      o.notes.push_back(named(codes == &o.tee ? "tee" : "redirects") + " names local rank " +
                        std::to_string(codes->by_rank.rbegin()->first) + ", which is ignored: " +
                        named("nproc_per_node") + "=" +
                        std::to_string(o.nproc_per_node) + " gives local ranks 0 to " +
                        std::to_string(o.nproc_per_node - 1));
    }
  }
  if (virtual_local_rank) {
    // As torchrun: each worker sees one device, as device 0 with
    // LOCAL_RANK=0: the local rank's entry of CUDA_VISIBLE_DEVICES, or the
    // local rank itself when that is not set.
    const auto visible = env.find("CUDA_VISIBLE_DEVICES");
    if (visible == env.end()) {
      for (int local = 0; local < o.nproc_per_node; ++local) o.virtual_devices.push_back(std::to_string(local));
    } else {
      const std::string& list = visible->second;
      size_t start = 0;
      while (!list.empty()) {
        const size_t comma = list.find(',', start);
        std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (item.empty()) {
          return InvalidArgumentError("--virtual_local_rank: CUDA_VISIBLE_DEVICES='" + list +
                                      "' has an empty entry (each worker is given one device of it)");
        }
        o.virtual_devices.push_back(item);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      if (static_cast<int>(o.virtual_devices.size()) < o.nproc_per_node) {
        return InvalidArgumentError("--virtual_local_rank gives each worker one device of CUDA_VISIBLE_DEVICES='" +
                                    list + "', which names " + std::to_string(o.virtual_devices.size()) +
                                    ", fewer than --nproc_per_node=" + std::to_string(o.nproc_per_node));
      }
      o.virtual_devices.resize(o.nproc_per_node);
    }
  }
  if (!o.local_ranks_filter.empty() && o.local_ranks_filter.back() >= o.nproc_per_node) {
    return InvalidArgumentError("--local_ranks_filter names local rank " +
                                std::to_string(o.local_ranks_filter.back()) + ", but --nproc_per_node=" +
                                std::to_string(o.nproc_per_node) + " gives local ranks 0 to " +
                                std::to_string(o.nproc_per_node - 1));
  }
  return o;
}

}  // namespace

StatusOr<DdprunOptions> ParseDdprunArgs(int argc, const char* const* argv, const EnvMap& env) {
  std::vector<std::string> from_env;
  StatusOr<DdprunOptions> o = ParseWithPetDefaults(argc, argv, env, from_env);
  if (o.ok() || from_env.empty() || o.status().message().rfind("PET_", 0) == 0) return o;
  // A setting that clashes with another may have come from the environment.
  std::string names;
  for (const std::string& used : from_env) names += (names.empty() ? "" : ", ") + used;
  return Status(o.status().code(), o.status().message() + " (taken from the environment: " + names + ")");
}

namespace {

// ---- the multi-node protocol ----

std::string Key(int attempt, const std::string& rest) {
  return "ddprun/a" + std::to_string(attempt) + "/" + rest;
}

// Failure notices start with 'R' (the job may restart), 'F' (final: the
// posting launcher stops, so must everyone) or 'M' (c10d: launchers wait to
// join; the workers restart on more nodes, which is not counted against
// --max_restarts).
struct FailureNotice {
  bool restartable = true;
  bool membership = false;
  std::string reason;
};

enum class NoticeKind : char { kRestartable = 'R', kFinal = 'F', kMembership = 'M' };

std::optional<FailureNotice> DecodeFailure(const std::string& value) {
  if (value.empty()) return std::nullopt;
  return FailureNotice{value[0] != 'F', value[0] == 'M', value.substr(1)};
}

// The first failure posted for an attempt wins; later ones are dropped so
// that every launcher reports the same root cause. It is one call, a write
// only where no notice is yet: with a count bumped first and the notice
// written after, a launcher could see the count without the notice, and one
// that died in between left the count and never a notice.
Status PostFailure(store::TcpStoreClient& store, int attempt, NoticeKind kind, const std::string& reason,
                   Deadline deadline) {
  return store.CompareSet(Key(attempt, "failure"), std::nullopt, static_cast<char>(kind) + reason, deadline)
      .status();
}

Status PostFailure(store::TcpStoreClient& store, const DdprunOptions& o, int attempt, NoticeKind kind,
                   const std::string& reason) {
  return PostFailure(store, attempt, kind, reason,
                     DeadlineIn(std::min<milliseconds>(o.store_call_time, o.node_timeout)));
}

Status PostFailure(store::TcpStoreClient& store, const DdprunOptions& o, int attempt, bool restartable,
                   const std::string& reason) {
  return PostFailure(store, o, attempt, restartable ? NoticeKind::kRestartable : NoticeKind::kFinal,
                     reason);
}

// ---- stopping the job for good ----
//
// A launcher that ends the job (SIGINT, SIGTERM, SIGHUP or SIGQUIT; a fault of its
// own, such as workers that cannot start) sets Key(attempt, "stop") to its
// reason, and does so before its workers end, since their end makes the
// workers of other nodes fail within milliseconds and those nodes post
// restartable notices. The first failure notice of an attempt decides
// whether it restarts; a stop overrides it: every launcher looks for one
// before restarting, and the rendezvous of the next attempt (Rendezvous,
// FormRound, JoinRound) gives up as soon as one appears, in that attempt
// or the one before. The stop is also posted as a final failure notice,
// which stops the workers of the others at once when it is the first.

// Longest a stop notice may hold up an interrupted launcher's forwarding
// of the signal to its workers (a store that does not answer).
constexpr auto kStopNoticeTime = 2000ms;

Status PostStop(store::TcpStoreClient& store, const DdprunOptions& o, int attempt, const std::string& reason) {
  const Deadline deadline =
      DeadlineIn(std::min<milliseconds>({o.store_call_time, o.node_timeout, kStopNoticeTime}));
  DDP_RETURN_IF_ERROR(store.Set(Key(attempt, "stop"), reason, deadline));
  return PostFailure(store, attempt, NoticeKind::kFinal, reason, deadline);
}

// The reason of a stop posted for `attempt`, if any.
std::optional<std::string> PostedStop(store::TcpStoreClient& store, const DdprunOptions& o, int attempt) {
  if (attempt < 0) return std::nullopt;
  auto stop = store.TryGet(Key(attempt, "stop"), DeadlineIn(std::min<milliseconds>(o.store_call_time, o.node_timeout)));
  if (!stop.ok() || !stop->has_value()) return std::nullopt;
  return **stop;
}

// For the rendezvous of `attempt`: ABORTED when this launcher was
// interrupted (InterruptSignal; the caller tells the others) or a stop was
// posted for this attempt or the one before it.
Status CheckStop(store::TcpStoreClient& store, const DdprunOptions& o, int attempt) {
  if (const int signo = InterruptSignal(); signo != 0) {
    return AbortedError("interrupted by " + SignalName(signo));
  }
  for (int a : {attempt - 1, attempt}) {
    if (std::optional<std::string> stop = PostedStop(store, o, a)) {
      return AbortedError(*stop + "; the job stops without " +
                          (attempt == 0 ? std::string("starting") : "restart " + std::to_string(attempt)));
    }
  }
  return Status::Ok();
}

// Watches one attempt from one node: waits on the failure key in slices,
// beats this node's heartbeat between them, and on node 0 declares nodes
// whose heartbeat stopped dead.
class NodeMonitor {
 public:
  // `admit_waiting` (node 0 of an elastic job with room for more nodes):
  // launchers waiting to join end the attempt with a membership notice.
  NodeMonitor(store::TcpStoreClient& store, const DdprunOptions& options, int attempt,
              bool admit_waiting = false)
      : store_(store), options_(options), attempt_(attempt), admit_waiting_(admit_waiting) {
    const Deadline now = Clock::now();
    for (int node = 0; node < options.nnodes; ++node) last_seen_[node] = {"", now};
    last_reached_ = now;
  }

  // One round of at most `slice`: waits on the failure key, then beats.
  // Returns the failure notice when the attempt failed (here or elsewhere).
  std::optional<FailureNotice> Poll(milliseconds slice) {
    StatusOr<std::string> failure = store_.Get(Key(attempt_, "failure"), DeadlineIn(slice));
    if (failure.ok()) return DecodeFailure(*failure);
    if (failure.status().code() != StatusCode::kTimedOut) return StoreLost(failure.status());
    return Beat();
  }

  // Like Poll, without waiting.
  std::optional<FailureNotice> Check() {
    auto failure = store_.TryGet(Key(attempt_, "failure"), DeadlineIn(CallTime()));
    if (!failure.ok() && failure.status().code() != StatusCode::kTimedOut) {
      return StoreLost(failure.status());
    }
    if (!failure.ok()) return Beat();
    if (failure->has_value()) return DecodeFailure(**failure);
    return Beat();
  }

 private:
  static FailureNotice StoreLost(const Status& status) {
    return FailureNotice{false, false, "lost the rendezvous store (" + status.message() +
                                    "); the launcher of node 0 is gone"};
  }

  // Beats this node's heartbeat; node 0 also checks everyone else's. A
  // store that stays unreachable (a network partition: calls time out
  // instead of failing) for --node_timeout ends the attempt too.
  std::optional<FailureNotice> Beat() {
    ++beats_;
    const Deadline now = Clock::now();
    Status beat = store_.Set(Key(attempt_, "heartbeat/" + std::to_string(options_.node_rank)),
                             std::to_string(beats_), DeadlineIn(CallTime()));
    if (beat.ok()) {
      last_reached_ = Clock::now();
    } else if (beat.code() != StatusCode::kTimedOut) {
      return StoreLost(beat);
    } else if (now - last_reached_ >= options_.node_timeout) {
      return FailureNotice{
          false, false, "cannot reach the rendezvous store at " + options_.master_addr + " for " +
                     std::to_string(
                         std::chrono::duration_cast<milliseconds>(Clock::now() - last_reached_)
                             .count()) +
                     " ms (--node_timeout)"};
    }
    if (options_.node_rank != 0) return std::nullopt;
    if (std::optional<FailureNotice> waiting = CheckWaiting()) return waiting;
    return CheckHeartbeats();
  }

  std::optional<FailureNotice> CheckWaiting() {
    if (!admit_waiting_) return std::nullopt;
    auto waiting = store_.Add(Key(attempt_, "waiting"), 0, DeadlineIn(CallTime()));
    if (!waiting.ok() || *waiting == 0) return std::nullopt;
    const std::string reason = std::to_string(*waiting) + (*waiting == 1 ? " launcher waits" : " launchers wait") +
                               " to join the job";
    // Only a notice in the store ends the round everywhere; try again at
    // the next beat otherwise.
    if (!PostFailure(store_, options_, attempt_, NoticeKind::kMembership, reason).ok()) return std::nullopt;
    return FailureNotice{true, true, reason};
  }

  milliseconds CallTime() const { return std::min<milliseconds>(options_.store_call_time, options_.node_timeout); }

  std::optional<FailureNotice> CheckHeartbeats() {
    const Deadline now = Clock::now();
    for (int node = 1; node < options_.nnodes; ++node) {
      const Deadline deadline = DeadlineIn(CallTime());
      auto done = store_.TryGet(Key(attempt_, "done/" + std::to_string(node)), deadline);
      if (done.ok() && done->has_value()) continue;  // finished; it may stop beating
      auto beat = store_.TryGet(Key(attempt_, "heartbeat/" + std::to_string(node)), deadline);
      if (!beat.ok()) continue;
      const std::string value = beat->value_or("");
      auto& [last_value, last_change] = last_seen_[node];
      if (value != last_value) {
        last_value = value;
        last_change = now;
      } else if (now - last_change > options_.node_timeout) {
        const std::string reason =
            "node " + std::to_string(node) + "'s launcher sent no heartbeat for " +
            std::to_string(std::chrono::duration_cast<milliseconds>(now - last_change).count()) +
            " ms (--node_timeout)";
        (void)store_.Set(Key(attempt_, "dead/" + std::to_string(node)), "1",
                         DeadlineIn(CallTime()));
        (void)PostFailure(store_, options_, attempt_, /*restartable=*/true, reason);
        return FailureNotice{true, false, reason};
      }
    }
    return std::nullopt;
  }

  store::TcpStoreClient& store_;
  const DdprunOptions& options_;
  const int attempt_;
  const bool admit_waiting_;
  int64_t beats_ = 0;
  Deadline last_reached_{};  // last time a call to the store succeeded
  std::map<int, std::pair<std::string, Deadline>> last_seen_;
};

// "30", "0.5": milliseconds as the seconds a flag takes.
std::string SecondsText(milliseconds ms) {
  std::string text = std::to_string(ms.count() / 1000);
  if (const int64_t rest = ms.count() % 1000; rest != 0) {
    const std::string digits = std::to_string(1000 + rest);  // 50 ms: "1050", ".05"
    text += "." + digits.substr(1, digits.find_last_not_of('0'));
  }
  return text;
}

// Every launcher checks that it was started like node 0, since WORLD_SIZE and
// the restart count follow from these flags, and a launcher that gives up on
// the rendezvous at another time than node 0 leaves the others waiting for
// it, or gives up on them while node 0 still waits (the last call and the
// grace period count in how long node 0 may take to form a round,
// RoundFormingTime).
std::string ConfigLine(const DdprunOptions& o) {
  const std::string nnodes = o.nnodes_spec.empty() ? std::to_string(o.nnodes) : o.nnodes_spec;
  // --nproc_per_node is not compared: each node may run its own number of
  // workers, as under torchrun (c10d: node 0 publishes them with each
  // round's members; static: each node records its own, see Rendezvous).
  std::string line = "--nnodes=" + nnodes;
  line += " --max_restarts=" + std::to_string(o.max_restarts) + " --rdzv_backend=" + o.rdzv_backend;
  if (!o.rdzv_id.empty()) line += " --rdzv_id=" + o.rdzv_id;
  line += " --rdzv_timeout=" + SecondsText(o.rdzv_timeout);
  line += " --rdzv_conf=last_call_timeout=" + SecondsText(o.last_call);
  line += " --grace_period=" + SecondsText(o.grace);
  return line;
}

// The flags in which two ConfigLines differ: "--a=1 --b=2 but node 0 with
// --a=3 no --b" for this launcher's `mine` and node 0's `node0`.
std::string ConfigDifference(const std::string& mine, const std::string& node0) {
  std::vector<std::string> names;                // in the order they come
  std::map<std::string, std::string> values[2];  // name -> value, mine and node 0's
  for (int i = 0; i < 2; ++i) {
    const std::string& line = i == 0 ? mine : node0;
    for (size_t at = 0; at < line.size();) {
      const size_t end = std::min(line.find(' ', at), line.size());
      const std::string flag = line.substr(at, end - at);
      const size_t eq = std::min(flag.find('='), flag.size());
      const std::string name = flag.substr(0, eq);
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
      values[i][name] = flag.substr(std::min(eq + 1, flag.size()));
      at = end + 1;
    }
  }
  std::string text[2];
  for (const std::string& name : names) {
    auto shown = [&](int i) {
      const auto it = values[i].find(name);
      return it == values[i].end() ? "no " + name : name + "=" + it->second;
    };
    if (shown(0) == shown(1)) continue;
    for (int i : {0, 1}) text[i] += (text[i].empty() ? "" : " ") + shown(i);
  }
  return text[0] + " but node 0 with " + text[1];
}

// For a program that could not be found or run: what the user may have
// meant, as "; ..." (empty when nothing comes to mind). torchrun takes a
// Python script as its program; ddprun takes the interpreter.
std::string ProgramHint(const std::string& program) {
  std::string hint;
  bool script = program.size() > 3 && program.compare(program.size() - 3, 3, ".py") == 0;
  if (program.find('/') == std::string::npos) {
    struct stat st{};
    if (stat(program.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      if (access(program.c_str(), X_OK) == 0) {
        if (!script) return "; for the one in the current folder give its path: ./" + program;
      } else {
        hint += "; '" + program + "' in the current folder is not executable";
      }
      script = true;
    }
  }
  if (script) hint += "; for a Python script give the interpreter: ddprun ... python3 " + program;
  return hint;
}

// torchrun's only argument macro (macros.substitute): "${local_rank}" or
// "$local_rank" (not followed by a letter, digit or '_') in an argument of
// PROGRAM becomes the worker's local rank. "$$" is left alone (and does not
// start one: "$${local_rank}" stays), so that a shell's "$$" still works.
std::string SubstituteLocalRank(const std::string& arg, int local_rank) {
  if (arg.find('$') == std::string::npos) return arg;
  static constexpr std::string_view kBraced = "${local_rank}";
  static constexpr std::string_view kBare = "$local_rank";
  std::string out;
  for (size_t i = 0; i < arg.size();) {
    const std::string_view rest = std::string_view(arg).substr(i);
    if (rest.substr(0, 2) == "$$") {
      out += "$$";
      i += 2;
    } else if (rest.substr(0, kBraced.size()) == kBraced) {
      out += std::to_string(local_rank);
      i += kBraced.size();
    } else if (rest.substr(0, kBare.size()) == kBare &&
               (rest.size() == kBare.size() ||
                !(std::isalnum(static_cast<unsigned char>(rest[kBare.size()])) || rest[kBare.size()] == '_'))) {
      out += std::to_string(local_rank);
      i += kBare.size();
    } else {
      out += arg[i++];
    }
  }
  return out;
}

// torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, filled in as Python's
// string.Template.safe_substitute does: "$name" or "${name}" for rank,
// local_rank and role_name, "$$" for "$", anything else left as it is.
std::string LinePrefix(const std::string& pattern, int rank, int local_rank, const std::string& role) {
  auto value_of = [&](std::string_view name) -> std::optional<std::string> {
    if (name == "rank") return std::to_string(rank);
    if (name == "local_rank") return std::to_string(local_rank);
    if (name == "role_name") return role;
    return std::nullopt;
  };
  auto is_start = [](char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; };
  auto is_part = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    if (pattern[i] != '$' || i + 1 == pattern.size()) {
      out += pattern[i++];
      continue;
    }
    if (pattern[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    const bool braced = pattern[i + 1] == '{';
    const size_t start = i + (braced ? 2 : 1);
    size_t end = start;
    if (end < pattern.size() && is_start(pattern[end])) {
      while (end < pattern.size() && is_part(pattern[end])) ++end;
    }
    const std::optional<std::string> value =
        end > start && (!braced || (end < pattern.size() && pattern[end] == '}'))
            ? value_of(std::string_view(pattern).substr(start, end - start))
            : std::nullopt;
    if (!value) {
      out += pattern[i++];
      continue;
    }
    out += *value;
    i = end + (braced ? 1 : 0);
  }
  return out;
}

std::string Hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// The last line Say printed: the launcher's own reason when it fails
// before (or without) a worker's (see RecordLauncherError).
std::mutex g_said_mu;
std::string g_last_said;

void Say(const std::string& line) {
  {
    std::lock_guard<std::mutex> lock(g_said_mu);
    g_last_said = line;
  }
  WriteLauncherLine("ddprun: " + line + "\n");
}

// ---- static rendezvous: who holds a node rank ----
//
// The launcher holding node rank R in an attempt ("holder/R": "<host>
// <pid>", claimed with a compare-and-set, so that of two claims one wins)
// beats "heartbeat/R" from its claim to the attempt's end: while it waits
// for the other nodes, and while its workers run (NodeMonitor). Another
// launcher given R takes it over only from a holder that is gone: at once
// when it ran on this host and its pid is gone; else (another host, whose
// pids mean nothing here, or a pid that runs on but is stopped or cut off
// from the store) once its heartbeat stood still for --node_timeout (node
// 0's), as node 0 declares a running node dead. A holder that was only
// silent finds the rank taken at its next beat and leaves before it starts
// workers; and a launcher takes over only while some node has not
// registered yet: once all have, the attempt runs (or ran) with the gone
// holder, node 0 ends it when the heartbeat stays missing, and the
// newcomer joins the restart instead. Node 0 publishes the attempt it is
// in (kAttemptKey), so that a launcher relaunched while the job is at
// restart K meets the others there and not in attempt 0.

constexpr char kAttemptKey[] = "ddprun/attempt";

// Each node's --nproc_per_node ("ddprun/nproc/<R>"), which may differ from
// node to node, as under torchrun: RANK and WORLD_SIZE follow from them all
// (node R's first rank is the sum of nodes 0 to R - 1's counts). Recorded
// once per job by the first launcher that registers for R, with a
// compare-and-set, so that it is the same in every attempt: a launcher
// relaunched for R (a takeover, or one joining a restart) with another
// count would shift the ranks of the nodes after it under them, and may
// have registered before they read the counts; it is refused instead.
constexpr char kNprocKeyPrefix[] = "ddprun/nproc/";

// `holder` is "<host> <pid>" of the launcher that claimed a node rank: its
// pid when that launcher ran on this host and is gone.
std::optional<pid_t> GoneLauncherHere(const std::string& holder) {
  const size_t space = holder.rfind(' ');
  if (space == std::string::npos || holder.substr(0, space) != Hostname()) return std::nullopt;
  const std::string_view text = std::string_view(holder).substr(space + 1);
  pid_t pid = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), pid);
  if (error != std::errc() || end != text.data() + text.size() || pid <= 0 || pid == getpid()) {
    return std::nullopt;
  }
  if (kill(pid, 0) == 0 || errno != ESRCH) return std::nullopt;
  return pid;
}

// "the launcher on HOST (pid PID)" for a holder "<host> <pid>".
std::string HolderName(const std::string& holder) {
  const size_t space = holder.rfind(' ');
  if (space == std::string::npos) return "the launcher '" + holder + "'";
  return "the launcher on " + holder.substr(0, space) + " (pid " + holder.substr(space + 1) + ")";
}

// How the launcher `holder` that holds --node_rank in `attempt` is gone
// ("launcher pid P on this host, which is gone"); nullopt when it lives:
// its heartbeat moved within --node_timeout.
StatusOr<std::optional<std::string>> GoneHolder(store::TcpStoreClient& store, const DdprunOptions& o, int attempt,
                                                const std::string& holder) {
  if (std::optional<pid_t> pid = GoneLauncherHere(holder)) {
    return std::optional<std::string>("launcher pid " + std::to_string(*pid) + " on this host, which is gone");
  }
  // The holder beats by node 0's --node_timeout (or a shorter one of its
  // own), whatever this launcher was given.
  DDP_ASSIGN_OR_RETURN(std::optional<std::string> node0_ms,
                       store.TryGet(kNodeTimeoutKey, DeadlineIn(o.store_call_time)));
  const std::optional<int64_t> parsed = node0_ms ? ParseInt(*node0_ms) : std::nullopt;
  const milliseconds silence = parsed && *parsed > 0 ? milliseconds(*parsed) : o.node_timeout;
  const std::string key = Key(attempt, "heartbeat/" + std::to_string(o.node_rank));
  DDP_ASSIGN_OR_RETURN(std::optional<std::string> first, store.TryGet(key, DeadlineIn(o.store_call_time)));
  const Deadline start = Clock::now();
  // The store cannot wait for a value to change: a look every 50 ms, as
  // FormRound's, against a beat every monitor slice.
  while (Clock::now() - start < silence) {
    if (const int signo = InterruptSignal(); signo != 0) return AbortedError("interrupted by " + SignalName(signo));
    std::this_thread::sleep_for(50ms);
    DDP_ASSIGN_OR_RETURN(std::optional<std::string> now, store.TryGet(key, DeadlineIn(o.store_call_time)));
    if (now != first) return std::optional<std::string>();
  }
  return std::optional<std::string>(
      HolderName(holder) + ", which sent no heartbeat for " +
      std::to_string(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count()) +
      " ms (--node_timeout)");
}

// `attempt` ran (or runs) without this launcher, whose node rank a launcher
// now gone held in it: waits for it to fail, as it does once node 0 misses
// that launcher's heartbeat. OK when the job restarts; FAILED_PRECONDITION
// when it stops instead.
Status AwaitRestart(store::TcpStoreClient& store, const DdprunOptions& o, int attempt) {
  const Deadline deadline = DeadlineIn(o.rdzv_timeout);
  while (true) {
    if (const int signo = InterruptSignal(); signo != 0) return AbortedError("interrupted by " + SignalName(signo));
    StatusOr<std::string> posted =
        store.Get(Key(attempt, "failure"), std::min(deadline, DeadlineIn(MonitorSlice(o))));
    if (posted.ok()) {
      const std::optional<FailureNotice> notice = DecodeFailure(*posted);
      std::optional<std::string> stop = PostedStop(store, o, attempt);
      // Static restarts are all failure restarts: `attempt` of them so far.
      if (!stop && notice && notice->restartable && attempt < o.max_restarts) return Status::Ok();
      return FailedPreconditionError("the job stops (" + stop.value_or(notice ? notice->reason : *posted) +
                                     ") without a restart that this launcher could join");
    }
    if (posted.status().code() != StatusCode::kTimedOut) return posted.status();
    if (Clock::now() >= deadline) {
      return TimedOutError("attempt " + std::to_string(attempt) +
                           ", which runs without this launcher, did not end within --rdzv_timeout (" +
                           std::to_string(o.rdzv_timeout.count()) + " ms)");
    }
  }
}

// A node rank claimed twice in `attempt`: the line every launcher prints.
std::optional<std::string> DuplicateRank(store::TcpStoreClient& store, const DdprunOptions& o, int attempt) {
  auto duplicate = store.TryGet(Key(attempt, "duplicate"), DeadlineIn(o.store_call_time));
  if (!duplicate.ok() || !duplicate->has_value()) return std::nullopt;
  return **duplicate;
}

// Claims --node_rank in `attempt` (see above) and waits for every node to
// register; names the missing ones. Moves `attempt` on past attempts that
// run without this launcher. INVALID_ARGUMENT when two live launchers were
// given the same --node_rank: the second to claim it is refused at once
// and records the fact; every launcher that was waiting refuses the job
// when the wait ends (and posts the refusal, which stops any launcher that
// already started its workers). A duplicate that comes after everyone
// looked is refused alone; the job it did not join goes on. On success
// `nprocs` holds the --nproc_per_node of node 0, 1, ... (kNprocKeyPrefix);
// INVALID_ARGUMENT, before the rank is claimed, when this node's count
// differs from the one recorded for it in this job.
Status Rendezvous(store::TcpStoreClient& store, const DdprunOptions& o, int& attempt, std::vector<int>& nprocs) {
  const std::string rank = std::to_string(o.node_rank);
  const std::string me = Hostname() + " " + std::to_string(getpid());
  auto call = [&] { return DeadlineIn(o.store_call_time); };
  const std::string nproc = std::to_string(o.nproc_per_node);
  DDP_ASSIGN_OR_RETURN(std::optional<std::string> recorded,
                       store.CompareSet(kNprocKeyPrefix + rank, std::nullopt, nproc, call()));
  if (recorded != nproc) {
    return InvalidArgumentError(
        "--nproc_per_node=" + nproc + " differs from node " + rank + "'s --nproc_per_node=" +
        recorded.value_or("?") + ", recorded by its first launcher in this job; a node keeps its number of "
        "workers for the whole job (restarts included), since the ranks of the nodes after it and WORLD_SIZE "
        "follow from it: relaunch it with --nproc_per_node=" + recorded.value_or("?") +
        ", or restart every node");
  }
  auto all_registered = [&]() -> StatusOr<bool> {
    for (int node = 0; node < o.nnodes; ++node) {
      DDP_ASSIGN_OR_RETURN(std::optional<std::string> present,
                           store.TryGet(Key(attempt, "node/" + std::to_string(node)), call()));
      if (!present) return false;
    }
    return true;
  };
  while (true) {
    const std::string holder_key = Key(attempt, "holder/" + rank);
    DDP_ASSIGN_OR_RETURN(std::optional<std::string> holder, store.CompareSet(holder_key, std::nullopt, me, call()));
    if (holder == me) break;
    std::optional<std::string> gone;
    if (holder) {
      DDP_ASSIGN_OR_RETURN(gone, GoneHolder(store, o, attempt, *holder));
    }
    if (gone) {
      // In one step, so that of two launchers relaunched at once one takes
      // the rank over and the other is a duplicate.
      DDP_ASSIGN_OR_RETURN(holder, store.CompareSet(holder_key, holder, me, call()));
    }
    if (holder != me) {
      const std::string first = holder ? holder->substr(0, holder->rfind(' ')) : "another host";
      const std::string line = "--node_rank=" + rank + " was given to two launchers (one on " + first +
                               ", one on " + Hostname() + "); every node needs its own --node_rank";
      (void)store.Set(Key(attempt, "duplicate"), line, call());
      return InvalidArgumentError(line);
    }
    // Looked at after the takeover: a holder that saw every node register
    // before it may have gone on to start its workers.
    DDP_ASSIGN_OR_RETURN(bool registered, all_registered());
    if (!registered) {
      Say("node " + rank + ": takes --node_rank=" + rank + " over from " + *gone);
      break;
    }
    Say("node " + rank + ": --node_rank=" + rank + " was held by " + *gone + ", in " +
        (attempt == 0 ? std::string("the job's first attempt") : "restart " + std::to_string(attempt)) +
        ", which every node had joined; this launcher joins the restart that follows");
    DDP_RETURN_IF_ERROR(AwaitRestart(store, o, attempt));
    ++attempt;
  }
  const std::string holder_key = Key(attempt, "holder/" + rank);
  DDP_RETURN_IF_ERROR(store.Set(Key(attempt, "node/" + rank), Hostname(), call()));
  // Beats while it waits, and leaves once another launcher took the rank
  // over. A beat whose store call times out is let pass, except the last
  // one, before the workers start, which must know who holds the rank.
  int64_t beats = 0;
  auto beat = [&](bool must_answer) -> Status {
    StatusOr<std::optional<std::string>> holder = store.TryGet(holder_key, call());
    if (holder.ok() && *holder != me) {
      return FailedPreconditionError("--node_rank=" + rank + " was taken over by " +
                                     HolderName(holder->value_or("?")) +
                                     " while this launcher sent no heartbeat for --node_timeout (stopped, or cut "
                                     "off from the store); it leaves the job to that one");
    }
    Status status = holder.status();
    if (status.ok()) {
      status = store.Set(Key(attempt, "heartbeat/" + rank), "rendezvous " + std::to_string(++beats), call());
    }
    if (status.code() != StatusCode::kTimedOut) return status;
    if (!must_answer) return Status::Ok();
    return UnavailableError("cannot tell whether this launcher still holds --node_rank=" + rank + ": " +
                            status.message());
  };
  std::vector<std::string> keys;
  for (int node = 0; node < o.nnodes; ++node) keys.push_back(Key(attempt, "node/" + std::to_string(node)));
  // In slices, to give up as soon as a stop is posted or this launcher is
  // interrupted (ABORTED; the caller says goodbye).
  const Deadline deadline = DeadlineIn(o.rdzv_timeout);
  Status joined;
  while (true) {
    joined = beat(/*must_answer=*/false);
    if (joined.ok()) joined = CheckStop(store, o, attempt);
    if (joined.ok()) joined = store.Wait(keys, std::min(deadline, DeadlineIn(MonitorSlice(o))));
    if (joined.code() != StatusCode::kTimedOut || Clock::now() >= deadline) break;
  }
  // The last look at who holds the rank, before the workers start.
  if (joined.ok()) joined = beat(/*must_answer=*/true);
  if (joined.code() == StatusCode::kAborted) return joined;
  if (joined.ok() || joined.code() == StatusCode::kTimedOut) {
    if (std::optional<std::string> duplicate = DuplicateRank(store, o, attempt)) {
      (void)PostFailure(store, o, attempt, /*restartable=*/false, *duplicate);
      // Node 0's store stays up until the registered nodes have read it too.
      (void)store.Set(Key(attempt, "exit/" + rank), "1", DeadlineIn(o.store_call_time));
      if (o.node_rank == 0) {
        std::vector<std::string> acks;
        for (int node = 1; node < o.nnodes; ++node) {
          auto present = store.TryGet(keys[node], DeadlineIn(o.store_call_time));
          if (present.ok() && present->has_value()) acks.push_back(Key(attempt, "exit/" + std::to_string(node)));
        }
        (void)store.Wait(acks, DeadlineIn(std::min<milliseconds>(kFarewellTime, o.node_timeout)));
      }
      return InvalidArgumentError(*duplicate);
    }
  }
  if (joined.ok()) {
    // Every node recorded its count before it registered.
    std::vector<std::string> nproc_keys;
    for (int node = 0; node < o.nnodes; ++node) nproc_keys.push_back(kNprocKeyPrefix + std::to_string(node));
    DDP_ASSIGN_OR_RETURN(std::vector<std::string> counts, store.MultiGet(nproc_keys, call()));
    nprocs.clear();
    for (int node = 0; node < o.nnodes; ++node) {
      const std::optional<int64_t> count = ParseInt(counts[node]);
      if (!count || *count < 1 || *count > kMaxProcPerNode) {
        return InternalError("malformed --nproc_per_node '" + counts[node] + "' of node " + std::to_string(node) +
                             " in the store (" + nproc_keys[node] + ")");
      }
      nprocs.push_back(static_cast<int>(*count));
    }
    return joined;
  }
  if (joined.code() != StatusCode::kTimedOut) return joined;
  // The first few missing nodes by name, then how many more.
  constexpr int kNamed = 10;
  std::string missing;
  int missing_count = 0;
  for (int node = 0; node < o.nnodes; ++node) {
    auto present = store.TryGet(keys[node], DeadlineIn(o.store_call_time));
    if (!present.ok() || present->has_value()) continue;
    if (++missing_count <= kNamed) missing += (missing.empty() ? "" : ", ") + std::to_string(node);
  }
  if (missing_count > kNamed) missing += " and " + std::to_string(missing_count - kNamed) + " more";
  return TimedOutError("not every node joined within --rdzv_timeout (" +
                       std::to_string(o.rdzv_timeout.count()) + " ms); missing node(s): " + missing);
}

// ---- c10d rounds ----
//
// With --rdzv_backend=c10d every start of the workers (the first and each
// restart) is a round k, formed under Key(k, ...): node 0 (the store's
// host) opens it ("ddprun/round" = k); each other launcher takes a slot
// (Add "joined"), writes its node rank of round k - 1 under "join/<slot>"
// (-1: none) and waits for "members", beating "alive/<slot>" meanwhile
// (node 0 leaves out a slot silent for --node_timeout, whose launcher died
// after taking it, and one taken before it opened the round that does not
// beat, and one that does not beat again after the round closed: see
// FormRound). Node 0 waits for enough slots (all
// of --nnodes, or with MIN:MAX at least MIN and then up to the last call
// for more), seats the launchers of the previous round first, in their old
// order, then the others in slot order, and publishes "members": the
// failure restarts so far, then the slot of node 1, 2, ... A launcher left
// out waits for the next round; in an elastic job with room it first adds
// itself to "waiting", and node 0 ends the running round for it (a
// membership notice, not counted against --max_restarts). So a node that
// died drops out at the next restart, a relaunched or new one comes in, and
// launchers beyond --nnodes wait as spares. When the job ends, node 0
// writes an end record as the next round's members, and waits a moment for
// the launchers waiting for that round to acknowledge it ("left/<slot>").

constexpr char kRoundKey[] = "ddprun/round";
// A round's "members" record when node 0 ends the job instead: "end <exit status>".
constexpr char kEndRecord[] = "end ";

struct Seat {
  int round = 0;
  int node_rank = 0;
  int nnodes = 1;
  int failures = 0;  // failure restarts before this round
  std::vector<int> nprocs;  // --nproc_per_node of node 0, 1, ... in this round
};

// A round's "nprocs" record ("2 1 4": --nproc_per_node of node 0, 1, ...)
// for `nnodes` nodes; nullopt when malformed.
std::optional<std::vector<int>> ParseNprocs(const std::string& record, int nnodes) {
  std::vector<int> nprocs;
  for (size_t at = 0; at < record.size();) {
    const size_t space = std::min(record.find(' ', at), record.size());
    const std::optional<int64_t> value = ParseInt(std::string_view(record).substr(at, space - at));
    if (!value || *value < 1 || *value > kMaxProcPerNode) return std::nullopt;
    nprocs.push_back(static_cast<int>(*value));
    at = space + 1;
  }
  if (static_cast<int>(nprocs.size()) != nnodes) return std::nullopt;
  return nprocs;
}

// How long node 0 may take to form a round: --rdzv_timeout for MIN nodes,
// the last call, and the wait for the previous round's nodes.
milliseconds RejoinTime(const DdprunOptions& o) { return o.grace + 5000ms; }
milliseconds RoundFormingTime(const DdprunOptions& o) {
  return o.rdzv_timeout + o.last_call + RejoinTime(o);
}

// Node 0: forms round `round`; returns the number of nodes in it.
// `returning` nodes of the previous round (those not declared dead) are
// waited for up to RejoinTime (they may still be stopping their workers)
// before anyone else takes a place or the last call starts, so that a
// restart keeps its nodes and their ranks.
StatusOr<int> FormRound(store::TcpStoreClient& store, const DdprunOptions& o, int max_nodes, int round,
                        int failures, int returning, std::vector<int>& nprocs) {
  const Deadline start = Clock::now();
  const Deadline deadline = start + o.rdzv_timeout;
  const Deadline rejoin_deadline = start + RejoinTime(o);
  DDP_RETURN_IF_ERROR(store.Set(kRoundKey, std::to_string(round), DeadlineIn(o.store_call_time)));
  const int min_nodes = o.min_nodes > 0 ? o.min_nodes : max_nodes;
  // The end of the last call, once at least MIN nodes are in (else none).
  bool calling = false;
  Deadline last_call{};
  // Slot -> the node rank its launcher had in the previous round (-1:
  // none). A slot counts once its launcher has written that (right after
  // taking it); one that died in between never counts.
  std::map<int64_t, int64_t> entries;
  std::map<int64_t, int> slot_nprocs;  // slot -> its launcher's --nproc_per_node
  // Slot -> its launcher's last heartbeat while it waits for the round
  // ("alive/<slot>"), when node 0 saw it change, and whether the slot
  // counts. One taken while node 0 watches counts at once; one it finds
  // at its first look was taken earlier (a spare, or a launcher waiting
  // for this restart, which may have died since) and counts once its beat
  // changes, which a live launcher's does within a monitor slice: until
  // then it holds the last call open, and after two slices and a half
  // second it is left out. A counted slot stops counting when silent for
  // --node_timeout (its launcher died after taking it), as under
  // torchrun's keep-alives; should it beat again before the round closes,
  // it counts again.
  struct Beat {
    std::string value;
    Deadline changed;
    bool alive = false;
  };
  std::map<int64_t, Beat> beats;
  std::set<int64_t> silent;  // slots reported silent
  std::vector<std::pair<int64_t, int64_t>> live;  // (slot, previous rank) of live slots
  const milliseconds unproven_for = 2 * MonitorSlice(o) + 500ms;
  // Slot -> its beat when it failed the confirmation below; it counts
  // again only once that changes.
  std::map<int64_t, std::string> lapsed;
  bool first_look = true;
  std::vector<std::pair<int64_t, int64_t>> order;  // (sort key, slot)
  int members = 1;
  while (true) {  // until a closed round is confirmed
    while (true) {  // until the round closes
      DDP_RETURN_IF_ERROR(CheckStop(store, o, round));
      DDP_ASSIGN_OR_RETURN(int64_t joined, store.Add(Key(round, "joined"), 0, DeadlineIn(o.store_call_time)));
      for (int64_t slot = 1; slot <= joined; ++slot) {
        if (entries.count(slot)) continue;
        DDP_ASSIGN_OR_RETURN(std::optional<std::string> previous,
                             store.TryGet(Key(round, "join/" + std::to_string(slot)), DeadlineIn(o.store_call_time)));
        if (!previous) continue;
        // "<previous rank> <nproc_per_node>"
        const size_t space = previous->find(' ');
        const std::optional<int64_t> rank = ParseInt(std::string_view(*previous).substr(0, space));
        const std::optional<int64_t> nproc =
            space == std::string::npos ? std::nullopt : ParseInt(std::string_view(*previous).substr(space + 1));
        if (!nproc || *nproc < 1 || *nproc > kMaxProcPerNode) {
          return InternalError("malformed join entry '" + *previous + "' of slot " + std::to_string(slot) +
                               " in the store");
        }
        entries[slot] = rank && *rank > 0 ? *rank : -1;
        slot_nprocs[slot] = static_cast<int>(*nproc);
      }
      live.clear();
      int back = 0;
      bool unproven = false;  // a slot found at the first look that has not beaten yet
      for (const auto& [slot, previous] : entries) {
        DDP_ASSIGN_OR_RETURN(std::optional<std::string> beat,
                             store.TryGet(Key(round, "alive/" + std::to_string(slot)), DeadlineIn(o.store_call_time)));
        const Deadline seen = Clock::now();
        auto [it, first] = beats.try_emplace(slot, Beat{beat.value_or(""), seen, !first_look});
        Beat& b = it->second;
        if (!first && b.value != beat.value_or("")) b = Beat{beat.value_or(""), seen, true};
        if (auto l = lapsed.find(slot); l != lapsed.end()) {
          if (l->second == b.value) continue;  // still silent since it failed the confirmation
          lapsed.erase(l);
        }
        const milliseconds quiet = std::chrono::duration_cast<milliseconds>(seen - b.changed);
        if (quiet > (b.alive ? o.node_timeout : unproven_for)) {
          if (silent.insert(slot).second) {
            Say("node 0: the launcher that joined " +
                (round == 0 ? std::string("the job") : "restart " + std::to_string(round)) + " in slot " +
                std::to_string(slot) + " sent no heartbeat for " + std::to_string(quiet.count()) + " ms" +
                (b.alive ? " (--node_timeout)" : "") + " and gets no place");
          }
          continue;
        }
        silent.erase(slot);
        if (!b.alive) {
          unproven = true;
          continue;
        }
        live.emplace_back(slot, previous);
        if (previous > 0) ++back;
      }
      first_look = false;
      const int64_t present = std::min<int64_t>(1 + static_cast<int64_t>(live.size()), max_nodes);
      const Deadline now = Clock::now();
      const bool awaiting_previous = back < returning && now < rejoin_deadline;
      if (!awaiting_previous) {
        // Slots can fall silent: below MIN again, the last call is off
        // until MIN are back (as torchrun drops its deadline).
        if (present < min_nodes) calling = false;
        if (present >= min_nodes && !calling) {
          calling = true;
          last_call = now + o.last_call;
        }
        if (present == max_nodes || (calling && now >= last_call && !unproven)) break;
      }
      if (!calling && now >= deadline) {
        return TimedOutError("only " + std::to_string(present) + " of " +
                             (min_nodes < max_nodes ? "at least " : "") + std::to_string(min_nodes) +
                             " nodes joined within --rdzv_timeout (" +
                             std::to_string(o.rdzv_timeout.count()) + " ms)" +
                             (round > 0 ? " for restart " + std::to_string(round) : "") +
                             (silent.empty() ? ""
                                             : " (" + std::to_string(silent.size()) +
                                                   " more took a place and then sent no heartbeat)"));
      }
      std::this_thread::sleep_for(50ms);
    }
    // The previous round's nodes in their old order, then the others in the
    // order they joined.
    order.clear();
    for (const auto& [slot, previous] : live) order.emplace_back(previous > 0 ? previous : kMaxNodes + slot, slot);
    std::sort(order.begin(), order.end());
    members = static_cast<int>(std::min<int64_t>(1 + static_cast<int64_t>(order.size()), max_nodes));

    // Confirmation: every launcher seated must beat once more after the round
    // closed (a live one beats every monitor slice). One that died shortly
    // before the close (less than --node_timeout: it still counted) would
    // otherwise be seated and found dead only once the workers run, at the
    // cost of a restart. Those that miss it are left out and the round stays
    // open; the window left is about a monitor slice.
    std::map<int64_t, std::string> unconfirmed;  // slot -> its beat at the close
    for (int i = 0; i + 1 < members; ++i) unconfirmed[order[i].second] = beats[order[i].second].value;
    const Deadline confirm_by = Clock::now() + unproven_for;
    while (!unconfirmed.empty()) {
      for (auto it = unconfirmed.begin(); it != unconfirmed.end();) {
        DDP_ASSIGN_OR_RETURN(std::optional<std::string> beat,
                             store.TryGet(Key(round, "alive/" + std::to_string(it->first)),
                                          DeadlineIn(o.store_call_time)));
        it = beat.value_or("") != it->second ? unconfirmed.erase(it) : std::next(it);
      }
      if (unconfirmed.empty() || Clock::now() >= confirm_by) break;
      std::this_thread::sleep_for(50ms);
    }
    if (unconfirmed.empty()) break;
    for (const auto& [slot, value] : unconfirmed) {
      lapsed[slot] = value;
      Say("node 0: the launcher in slot " + std::to_string(slot) + " of " +
          (round == 0 ? std::string("the job") : "restart " + std::to_string(round)) +
          " sent no heartbeat for " + std::to_string(unproven_for.count()) +
          " ms after the round closed and gets no place; waiting for the others again");
    }
  }
  std::string record = std::to_string(failures);
  for (int i = 0; i + 1 < members; ++i) record += " " + std::to_string(order[i].second);
  // Before "members", which the others wait for: they find it with it.
  nprocs = {o.nproc_per_node};
  for (int i = 0; i + 1 < members; ++i) nprocs.push_back(slot_nprocs[order[i].second]);
  std::string nprocs_record;
  for (int n : nprocs) nprocs_record += (nprocs_record.empty() ? "" : " ") + std::to_string(n);
  DDP_RETURN_IF_ERROR(store.Set(Key(round, "nprocs"), nprocs_record, DeadlineIn(o.store_call_time)));
  DDP_RETURN_IF_ERROR(store.Set(Key(round, "members"), record, DeadlineIn(o.store_call_time)));
  return members;
}

// What a launcher other than node 0 gets from JoinRound.
struct JoinResult {
  std::optional<Seat> seat;  // empty: the job ended first
  int job_exit = 1;          // then: node 0's exit status
};

const Status& StatusOf(const Status& status) { return status; }
template <typename T>
const Status& StatusOf(const StatusOr<T>& result) { return result.status(); }

// Other launchers: takes a seat in round `round` or, when left out, in a
// later one. `previous` is this launcher's node rank of round - 1 (-1:
// none). Waits for each round it tries up to RoundFormingTime from when
// node 0 opens it (as long as the job runs, for a spare). Both are the
// caller's and kept up to date, also when it returns an error: once left
// out of a round (node 0 closed it without this launcher, say after
// declaring it dead, or when it missed the confirmation beat), `round` is
// the next one, in which it waits as a spare, and `previous` is -1. Such a
// launcher is no longer a member of the running job: interrupted, it must
// leave without stopping it.
StatusOr<JoinResult> JoinRound(store::TcpStoreClient& store, const DdprunOptions& o, int max_nodes,
                               int& round, int& previous, const std::string& name) {
  Deadline deadline{};  // of the round tried, set below
  auto too_late = [&](const std::string& store_said) {
    return TimedOutError("node 0 did not form the job's " +
                         (round == 0 ? std::string("first round") : "restart " + std::to_string(round)) +
                         " within " + std::to_string(RoundFormingTime(o).count()) +
                         " ms (--rdzv_timeout, the last call and --grace_period + 5 s for the "
                         "previous round's nodes)" +
                         (store_said.empty() ? "" : "; the last call to the store got no answer: " + store_said));
  };
  // A call that times out (a store slow to answer, or out of reach for a
  // while) is made again until the deadline, as a running node rides out a
  // store that misses --rdzv_conf=read_timeout for up to --node_timeout: a
  // spare waits as long as the job runs, and one late answer must not end
  // it. Calls that are made again take another slot or beat once more,
  // which node 0 copes with (a slot without a join entry never counts).
  auto answered = [&](const auto& call) {
    while (true) {
      auto result = call(std::min(deadline, DeadlineIn(o.store_call_time)));
      if (StatusOf(result).code() != StatusCode::kTimedOut) return result;
      if (Clock::now() >= deadline) return decltype(result)(too_late(StatusOf(result).message()));
    }
  };
  while (true) {
    // Node 0 may still be running an earlier round (this launcher is a
    // spare, or came late): the clock starts once it opens this one.
    deadline = DeadlineIn(RoundFormingTime(o));
    DDP_ASSIGN_OR_RETURN(int64_t slot,
                         answered([&](Deadline d) { return store.Add(Key(round, "joined"), 1, d); }));
    DDP_RETURN_IF_ERROR(answered([&](Deadline d) {
      return store.Set(Key(round, "join/" + std::to_string(slot)),
                       std::to_string(previous) + " " + std::to_string(o.nproc_per_node), d);
    }));
    StatusOr<std::string> record = TimedOutError("");
    while (true) {
      // Beats under the slot once per monitor slice (a quarter of
      // --node_timeout, at most 1 s), so that node 0 seats it and keeps it
      // in the round it forms.
      record = store.Get(Key(round, "members"), std::min(deadline, DeadlineIn(MonitorSlice(o))));
      if (record.ok() || record.status().code() != StatusCode::kTimedOut) break;
      DDP_RETURN_IF_ERROR(answered(
          [&](Deadline d) { return store.Add(Key(round, "alive/" + std::to_string(slot)), 1, d).status(); }));
      if (Status stop = CheckStop(store, o, round); !stop.ok()) {
        // Node 0 ends the job too, and need not wait for this launcher to
        // read that.
        (void)store.Set(Key(round, "left/" + std::to_string(slot)), "1", DeadlineIn(o.store_call_time));
        return stop;
      }
      DDP_ASSIGN_OR_RETURN(std::optional<std::string> current,
                           answered([&](Deadline d) { return store.TryGet(kRoundKey, d); }));
      const std::optional<int64_t> opened = current ? ParseInt(*current) : std::nullopt;
      if (opened && *opened < round) deadline = DeadlineIn(RoundFormingTime(o));
      if (Clock::now() >= deadline) return too_late("");
    }
    if (!record.ok()) return record.status();
    if (record->rfind(kEndRecord, 0) == 0) {
      // The job ended instead; node 0 waits for this acknowledgement.
      (void)store.Set(Key(round, "left/" + std::to_string(slot)), "1", DeadlineIn(o.store_call_time));
      const std::optional<int64_t> code = ParseInt(std::string_view(*record).substr(sizeof(kEndRecord) - 1));
      return JoinResult{std::nullopt, code ? static_cast<int>(*code) : 1};
    }
    std::vector<int64_t> fields;
    for (size_t at = 0; at < record->size();) {
      const size_t space = std::min(record->find(' ', at), record->size());
      const std::optional<int64_t> value = ParseInt(std::string_view(*record).substr(at, space - at));
      if (!value) return InternalError("malformed membership record '" + *record + "' in the store");
      fields.push_back(*value);
      at = space + 1;
    }
    if (fields.empty()) return InternalError("empty membership record in the store");
    const int nnodes = static_cast<int>(fields.size());  // node 0 and the seated slots
    for (int node = 1; node < nnodes; ++node) {
      if (fields[node] != slot) continue;
      DDP_ASSIGN_OR_RETURN(std::optional<std::string> nprocs_record,
                           answered([&](Deadline d) { return store.TryGet(Key(round, "nprocs"), d); }));
      std::optional<std::vector<int>> nprocs =
          nprocs_record ? ParseNprocs(*nprocs_record, nnodes) : std::nullopt;
      if (!nprocs) {
        return InternalError("malformed or missing workers-per-node record '" + nprocs_record.value_or("") +
                             "' for " + std::to_string(nnodes) + " nodes in the store");
      }
      return JoinResult{Seat{round, node, nnodes, static_cast<int>(fields[0]), *std::move(nprocs)}};
    }
    // Left out: no longer a member of the job; wait for the next round.
    previous = -1;
    if (nnodes < max_nodes) {
      DDP_RETURN_IF_ERROR(
          answered([&](Deadline d) { return store.Add(Key(round, "waiting"), 1, d).status(); }));
      Say(name + ": the job runs on " + std::to_string(nnodes) + (nnodes == 1 ? " node" : " nodes") +
          " (--nnodes=" + o.nnodes_spec + "); this launcher joins when node 0 restarts the workers");
    } else {
      Say(name + ": the job already runs on " + std::to_string(nnodes) +
          (nnodes == 1 ? " node" : " nodes") + " (--nnodes=" +
          (o.nnodes_spec.empty() ? std::to_string(max_nodes) : o.nnodes_spec) +
          "); this launcher waits as a spare for a restart");
    }
    ++round;
  }
}

struct AttemptOutcome {
  bool succeeded = false;
  bool restartable = false;
  int exit_code = 1;
  std::string reason;
  bool membership = false;  // a membership notice: restart, not counted
};

// What the job's failure came down to, for the launcher's own error file.
struct RootCause {
  /// The last attempt's root-cause worker (the failed one whose error file
  /// was written first), when one wrote its error file.
  std::optional<WorkerExit> worker;
  std::string reason;  ///< The last attempt's failure line, once its workers ran.
  // Both are cleared at the start of each attempt; without either, the
  // launcher's last line stands for the cause.
};

int RunJob(const DdprunOptions& options, RootCause& cause);

// torchrun's @record on its own main: on a failure, the launcher's
// TORCHELASTIC_ERROR_FILE (the one it was started with, when its own
// launcher or scheduler asked) gets the root-cause worker's error, as
// torchrun copies that worker's file there, else the launcher's reason.
void RecordLauncherError(const DdprunOptions& o, const RootCause& cause, int exit_code) {
  if (o.error_file.empty() || exit_code == 0) return;
  Status written;
  if (cause.worker && !cause.worker->error_record.empty()) {
    // As torchrun: the worker's whole record (its traceback included), with
    // the worker's exit code, or minus its signal, as the errorCode.
    const WorkerExit& w = *cause.worker;
    written = CopyErrorRecord(o.error_file, w.error_record, w.signaled ? -w.code : w.code);
  } else if (cause.worker && !cause.worker->error.empty()) {
    const auto when = cause.worker->error_timestamp_us > 0
                          ? std::chrono::system_clock::time_point(
                                std::chrono::microseconds(cause.worker->error_timestamp_us))
                          : std::chrono::system_clock::now();
    written = WriteErrorFile(o.error_file, cause.worker->error, when);
  } else {
    std::string reason = cause.reason;
    if (reason.empty()) {
      std::lock_guard<std::mutex> lock(g_said_mu);
      reason = g_last_said;
    }
    if (reason.empty()) reason = "the launcher ended with exit status " + std::to_string(exit_code);
    written = WriteErrorFile(o.error_file, "ddprun: " + reason);
  }
  if (!written.ok()) Say("cannot write " + std::string(kEnvErrorFile) + ": " + written.message());
}

}  // namespace

int RunDdprun(const DdprunOptions& options) {
  RootCause cause;
  const int exit_code = RunJob(options, cause);
  RecordLauncherError(options, cause, exit_code);
  return exit_code;
}

namespace {

// A folder that could not be made: RESOURCE_EXHAUSTED when the file
// system or this process ran out of something (space, quota, inodes,
// descriptors, memory) or failed (EIO), which is no fault of the path
// given; INVALID_ARGUMENT otherwise (no such parent, no permission, a
// file in the way, read-only).
Status FolderError(int err, std::string text) {
  const bool system = err == ENOSPC || err == EDQUOT || err == EMFILE || err == ENFILE || err == ENOMEM ||
                      err == EIO;
  return system ? ResourceExhaustedError(std::move(text) + " (a failure of the system, not bad input)")
                : InvalidArgumentError(std::move(text));
}

// The exit status for a failure before anything started: 2 for what the
// user gave wrongly (a bad path, a port taken or privileged, an address
// not this host's), 1 for a failure of the system, as for any job failure.
int SetupExitCode(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kPermissionDenied:
      return 2;
    default:
      return 1;
  }
}

// This run's folder under --log_dir, made anew: <log_dir>/<rdzv_id>_<6
// random characters> ("none_" without --rdzv_id), as torchrun makes
// <log_dir>/<run_id>_<random>/ (mkdtemp), so that a run never overwrites
// or deletes the logs and error files of an earlier one in the same
// --log_dir. Its parents are made as needed.
StatusOr<std::string> MakeRunLogDir(const std::string& log_dir, const std::string& rdzv_id) {
  for (size_t pos = log_dir.find('/', 1);; pos = log_dir.find('/', pos + 1)) {
    const std::string partial = log_dir.substr(0, pos);
    if (!partial.empty() && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      return FolderError(err, "cannot create --log_dir '" + partial + "': " + std::strerror(err));
    }
    if (pos == std::string::npos) break;
  }
  std::string name = rdzv_id.empty() ? "none" : rdzv_id;
  std::replace(name.begin(), name.end(), '/', '_');
  std::string path = log_dir + "/" + name + "_XXXXXX";
  if (mkdtemp(path.data()) == nullptr) {
    const int err = errno;
    return FolderError(err, "cannot create a folder for this run's logs in --log_dir '" + log_dir + "': " +
                                std::strerror(err));
  }
  chmod(path.c_str(), 0755);  // mkdtemp's 0700; the logs are no secret
  return path;
}

// The files of a local rank's folder whose -t/-r codes make up `streams`:
// its log files, one per stream teed or redirected, and its error file.
std::string RankFileNames(int streams) {
  const std::string logs = streams == kBothStreams     ? "stdout.log, stderr.log and "
                           : streams == kStdoutStream ? "stdout.log and "
                           : streams == kStderrStream ? "stderr.log and "
                                                      : "";
  return logs + "error.json";
}

// "0, 2-4": local ranks, ascending, in runs.
std::string RankRuns(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ", ") + std::to_string(ranks[i]) +
            (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return text;
}

// The start-up line naming the files this run writes under `run_dir`. As
// torchrun's: a worker's output goes to files only for the streams --tee
// or --redirects give its local rank; every worker is given an error file
// (its TORCHELASTIC_ERROR_FILE), which exists only if the worker writes its
// error there (torch's @record, RecordWorkerError): ddprun writes none for
// it. When the local ranks' files differ (-r 0:1,1:2), each set is named
// with its ranks, so that no file is named for a rank that never writes it.
std::string RunLogsLine(const std::string& run_dir, const DdprunOptions& o) {
  std::map<int, std::vector<int>> ranks_by_streams;
  std::vector<int> order;  // the stream sets, by their lowest local rank
  for (int local = 0; local < o.nproc_per_node; ++local) {
    const int streams = o.tee.For(local) | o.redirects.For(local);
    if (ranks_by_streams[streams].empty()) order.push_back(streams);
    ranks_by_streams[streams].push_back(local);
  }
  const std::string folder = run_dir + "/attempt_K/LOCAL_RANK/";
  const std::string if_written = " (error.json only if the worker writes its error there: it is its "
                                 "TORCHELASTIC_ERROR_FILE)";
  if (order.size() == 1) {
    return (order[0] == 0 ? "this run's error files: " : "this run's logs: ") + folder + RankFileNames(order[0]) +
           if_written;
  }
  std::string line = "this run's logs: " + folder + " holds ";
  for (size_t i = 0; i < order.size(); ++i) {
    const std::vector<int>& ranks = ranks_by_streams[order[i]];
    line += (i == 0 ? "" : "; ") + RankFileNames(order[i]) + " for local rank" + (ranks.size() > 1 ? "s " : " ") +
            RankRuns(ranks);
  }
  return line + if_written;
}

int RunJob(const DdprunOptions& options, RootCause& cause) {
  DdprunOptions o = options;  // with --rdzv_backend=c10d, node_rank is found below
  // ---- checks that need the system, still before anything starts ----
  StatusOr<std::string> program = ResolveProgram(o.command[0]);
  if (!program.ok()) {
    Say(program.status().message() + ProgramHint(o.command[0]));
    return 2;
  }
  if (o.log_dir.empty() && o.temp_log_dir) {
    // As torchrun's DefaultLogsSpecs without a log_dir: tempfile.mkdtemp(
    // prefix="torchelastic_"), with this run's folder inside it.
    const char* tmp = std::getenv("TMPDIR");
    std::string base = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/torchelastic_XXXXXX";
    if (mkdtemp(base.data()) == nullptr) {
      // Neither TMPDIR nor /tmp is a flag: a failure there is the
      // system's (exit 1), whatever errno says.
      Say("cannot create a temporary folder for the logs of --tee/--redirects ('" + base +
          "'): " + std::strerror(errno) + "; give --log_dir=DIR");
      return 1;
    }
    o.log_dir = base;
  }
  std::string run_id;  // DDP_RUN_ID: node 0's, for the whole run
  std::vector<int> node_nprocs;  // several nodes: --nproc_per_node of node 0, 1, ... this attempt
  if (o.standalone) {
    // Made before the log folder, which is named after it as torchrun
    // names it after its --standalone run id.
    StatusOr<std::string> fresh = GenerateJobToken();
    if (!fresh.ok()) {
      Say("cannot make this run's id: " + fresh.status().message());
      return 1;  // the system's randomness failed: no bad input
    }
    run_id = fresh->substr(0, 16);
  }
  if (!o.log_dir.empty()) {
    StatusOr<std::string> run_dir = MakeRunLogDir(o.log_dir, o.standalone ? run_id : o.rdzv_id);
    if (!run_dir.ok()) {
      Say(run_dir.status().message());
      return SetupExitCode(run_dir.status());
    }
    Say(RunLogsLine(*run_dir, o));
    o.log_dir = *run_dir;  // from here on, the folder the workers' logs go to
  }
  std::string token = o.job_token;
  if (token.empty()) {
    StatusOr<std::string> fresh = GenerateJobToken();
    if (!fresh.ok()) {
      Say("cannot make the job's token: " + fresh.status().message());
      return 1;  // the system's randomness failed: no bad input
    }
    token = *fresh;
  }
  std::unique_ptr<store::TcpStoreServer> server;
  int port = o.master_port;
  // Assigned node ranks: whoever can listen on the endpoint serves the store
  // and is node 0; the others learn their rank from the store below.
  std::string not_served;
  if (o.node_rank == 0 && o.assign_node_rank && o.is_host == false) {
    o.node_rank = -1;  // --rdzv_conf=is_host=false: join node 0's store
  } else if (o.node_rank == 0) {
    store::TcpStoreServerOptions server_options;
    server_options.bind_address = o.master_addr;
    server_options.port = o.master_port;
    server_options.job_token = token;
    // Looking up --master_addr takes at most the 30 s default, less when
    // the whole rendezvous may take less.
    server_options.start_deadline = DeadlineIn(
        std::min<milliseconds>(o.rdzv_timeout, store::kDefaultServerStartTimeout));
    StatusOr<std::unique_ptr<store::TcpStoreServer>> started =
        store::TcpStoreServer::Start(server_options);
    if (started.ok()) {
      server = std::move(started).value();
      port = server->port();
      if (o.nnodes > 1 && server->loopback_only()) {
        Say("warning: the rendezvous store listens on loopback addresses only (what " + o.master_addr +
            " resolves to on this host): launchers on other hosts cannot reach it; give --master_addr "
            "(or --rdzv_endpoint) an address of this host that they can reach");
      }
    } else if (o.assign_node_rank && !o.is_host.has_value()) {
      not_served = started.status().message();
      o.node_rank = -1;
    } else {
      std::string hint;
      if (o.nnodes == 1 && started.status().code() == StatusCode::kFailedPrecondition) {
        // Two single-node jobs on one host both on the default 29500.
        hint = "; another job on this host may hold the port: give another --master_port, or "
               "--standalone (a free port)";
      }
      Say("cannot serve the rendezvous store: " + started.status().message() + hint);
      // A port taken or privileged, an address not this host's: 2; the
      // system failing (descriptors, a name service that did not answer): 1.
      return SetupExitCode(started.status());
    }
  }
  // How this launcher is named in messages before and after it has a rank.
  auto node_name = [&o] {
    return o.node_rank >= 0 ? "node " + std::to_string(o.node_rank) : std::string("launcher");
  };

  for (const std::string& note : o.notes) Say("note: " + note);

  // ---- the launchers meet (several nodes only) ----
  const bool multi_node = o.nnodes > 1;
  const std::string serve_note =
      not_served.empty() ? "" : " (this launcher could not serve the store itself: " + not_served + ")";
  std::unique_ptr<store::TcpStoreClient> client;
  int first_attempt = 0;  // static: the attempt node 0 is in, for a launcher started late
  if (multi_node) {
    const Deadline deadline = DeadlineIn(o.rdzv_timeout);
    auto connected = store::TcpStoreClient::Connect(o.master_addr, port, token, deadline);
    if (!connected.ok()) {
      Say(node_name() + ": " + connected.status().message() +
          (not_served.empty() ? "" : " (nor could this launcher serve it: " + not_served + ")"));
      return connected.status().code() == StatusCode::kPermissionDenied ? 2 : 1;
    }
    client = std::move(connected).value();
    if (o.node_rank == 0) {
      // Node 0 judges everyone's heartbeats by its --node_timeout, so the
      // others beat by it too (set first: whoever sees the configuration
      // sees it).
      Status s = client->Set(kNodeTimeoutKey, std::to_string(o.node_timeout.count()), DeadlineIn(o.store_call_time));
      if (s.ok()) s = client->Set("ddprun/config", ConfigLine(o), DeadlineIn(o.store_call_time));
      if (!s.ok()) {
        Say(s.message());
        return 1;
      }
    } else {
      // Checked before a node rank is taken, so that a launcher started
      // wrongly does not use one up.
      StatusOr<std::string> config = client->Get("ddprun/config", DeadlineIn(o.rdzv_timeout));
      if (!config.ok()) {
        Say(node_name() + ": " + config.status().message());
        return 1;
      }
      if (*config != ConfigLine(o)) {
        Say(node_name() + " was started with " + ConfigDifference(ConfigLine(o), *config) +
            "; every node needs the same flags" +
            serve_note);
        return 2;
      }
      StatusOr<std::optional<std::string>> timeout = client->TryGet(kNodeTimeoutKey, DeadlineIn(o.store_call_time));
      if (!timeout.ok()) {
        Say(node_name() + ": " + timeout.status().message());
        return 1;
      }
      const std::optional<int64_t> node0_ms = timeout->has_value() ? ParseInt(**timeout) : std::nullopt;
      if (node0_ms && *node0_ms > 0 && *node0_ms < o.node_timeout.count()) {
        Say(node_name() + ": beating by node 0's --node_timeout of " + std::to_string(*node0_ms) +
            " ms instead of this launcher's " + std::to_string(o.node_timeout.count()) + " ms");
        o.node_timeout = milliseconds(*node0_ms);
      }
      if (!o.assign_node_rank) {
        // Relaunched while the job is at restart K: the others wait there.
        StatusOr<std::optional<std::string>> at = client->TryGet(kAttemptKey, DeadlineIn(o.store_call_time));
        if (!at.ok()) {
          Say(node_name() + ": " + at.status().message());
          return 1;
        }
        const std::optional<int64_t> k = at->has_value() ? ParseInt(**at) : std::nullopt;
        if (k && *k > 0) {
          first_attempt = static_cast<int>(*k);
          Say(node_name() + ": the job is at restart " + std::to_string(first_attempt) +
              "; this launcher joins it there");
        }
      }
    }
  }

  // As torchrun: several workers on a node get one OpenMP thread each
  // unless the launcher's environment says otherwise.
  const bool omp_default = o.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
  // As torchrun: NCCL's watchdog tears a process down on a collective that
  // failed or timed out, unless the launcher's environment says otherwise
  // (which the workers inherit).
  const bool nccl_async_default = std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr;
  // Worker output that passes through this launcher (a "[rank] " prefix, log
  // files, --local_ranks_filter) reaches a worker as a pipe, and Python
  // buffers a pipe's stdout in 8 KiB blocks: a PyTorch program's print()
  // lines showed up minutes late, out of order with its stderr, and were
  // lost with a worker that was killed. Under torchrun (no --tee) the
  // workers write to the terminal itself, line by line; PYTHONUNBUFFERED=1
  // keeps that, unless the launcher's environment says otherwise.
  const bool log_files = o.tee.Any(o.nproc_per_node) || o.redirects.Any(o.nproc_per_node);
  const bool output_piped = (o.prefix && o.nproc_per_node > 1) || log_files || !o.local_ranks_filter.empty();
  const bool python_unbuffered_default = output_piped && std::getenv("PYTHONUNBUFFERED") == nullptr;
  const int max_nodes = o.nnodes;
  // Node 0 ends a c10d job instead of forming round `round`: the launchers
  // waiting for it learn the exit status; those seen so far are given up to
  // kFarewellTime to read it before the store goes away.
  auto publish_final = [&](int round, int code) {
    if (!client || o.node_rank != 0 || !o.assign_node_rank) return;
    const Deadline deadline = DeadlineIn(std::min<milliseconds>(o.store_call_time, o.node_timeout));
    if (!client->Set(Key(round, "members"), kEndRecord + std::to_string(code), deadline).ok()) return;
    auto waiting = client->Add(Key(round, "joined"), 0, deadline);
    std::vector<std::string> keys;
    for (int64_t slot = 1; waiting.ok() && slot <= *waiting; ++slot) {
      keys.push_back(Key(round, "left/" + std::to_string(slot)));
    }
    if (!keys.empty()) (void)client->Wait(keys, DeadlineIn(std::min<milliseconds>(kFarewellTime, o.node_timeout)));
  };
  // From here on, SIGINT, SIGTERM, SIGHUP and SIGQUIT while no workers run
  // are recorded instead of ending this launcher at once (a second one
  // still does): the waits below look for them, and with several nodes the
  // launcher tells the others before it leaves. A single node needs it too:
  // one between two attempts is reported and starts no restart, instead of
  // ending the launcher there without a word.
  CatchInterrupts(true);
  bool stop_posted = false;
  // Ends the job on every node (see PostStop); the first reason counts.
  auto post_stop = [&](int attempt, const std::string& reason) {
    if (!client || stop_posted) return;
    stop_posted = true;
    (void)PostStop(*client, o, attempt, reason);
  };
  // This launcher was interrupted while waiting for the nodes of `attempt`;
  // as a member of the job (not a spare) it ends the job. Returns its exit
  // status.
  auto leave_interrupted = [&](int attempt, bool member, const std::string& name) {
    const int signo = InterruptSignal();
    const std::string reason = name + ": interrupted by " + SignalName(signo) + " while waiting for " +
                               (attempt == 0 ? std::string("the other nodes") : "the nodes of restart " + std::to_string(attempt));
    if (member) post_stop(attempt, reason);
    Say(reason + (member ? "; the job stops" : ""));
    return 128 + signo;
  };
  // Static backend, after a rendezvous that gave up on a stop: node 0 keeps
  // the store up until the nodes that registered have read it.
  auto leave_rendezvous = [&](int attempt) {
    CatchInterrupts(false);
    const Deadline deadline = DeadlineIn(std::min<milliseconds>(o.store_call_time, o.node_timeout));
    (void)client->Set(Key(attempt, "exit/" + std::to_string(o.node_rank)), "1", deadline);
    if (o.node_rank != 0) return;
    std::vector<std::string> keys;
    for (int n = 1; n < o.nnodes; ++n) {
      auto present = client->TryGet(Key(attempt, "node/" + std::to_string(n)), deadline);
      if (present.ok() && present->has_value()) keys.push_back(Key(attempt, "exit/" + std::to_string(n)));
    }
    if (!keys.empty()) (void)client->Wait(keys, DeadlineIn(std::min<milliseconds>(kFarewellTime, o.node_timeout)));
  };
  // This launcher leaves the job after `attempt`, with exit status `code`:
  // node 0 of a c10d job tells the launchers waiting for the next round
  // (publish_final); every launcher says it has its answer ("exit/<node>"),
  // and node 0 keeps the store up until the other nodes of `attempt` (those
  // not declared dead) have said so too, at most kFarewellTime.
  auto farewell = [&](int attempt, int code) {
    CatchInterrupts(false);  // the farewell is bounded; Ctrl-C ends it at once
    if (!client) return;
    publish_final(attempt + 1, code);
    const milliseconds call_time = std::min<milliseconds>(o.store_call_time, o.node_timeout);
    (void)client->Set(Key(attempt, "exit/" + std::to_string(o.node_rank)), "1", DeadlineIn(call_time));
    if (o.node_rank != 0) return;
    // Nodes declared dead will not answer.
    std::vector<std::string> keys;
    for (int n = 0; n < o.nnodes; ++n) {
      auto dead = client->TryGet(Key(attempt, "dead/" + std::to_string(n)), DeadlineIn(call_time));
      if (dead.ok() && !dead->has_value()) keys.push_back(Key(attempt, "exit/" + std::to_string(n)));
    }
    (void)client->Wait(keys, DeadlineIn(std::min<milliseconds>(kFarewellTime, o.node_timeout)));
  };
  int exit_code = 1;
  int failures = 0;  // failure restarts so far (membership restarts are not counted)
  int previous_rank = -1;  // this launcher's node rank in the last round it ran
  int returning = 0;       // node 0: nodes of the last round expected back
  bool started = false;    // this launcher has started workers before
  int torch_port = 0;  // the workers' MASTER_PORT, for PyTorch's own rendezvous
  for (int attempt = first_attempt;; ++attempt) {
    // Each attempt reports its own cause: one that fails before its workers
    // run (rendezvous, store, spawn) must not leave the last attempt's worker
    // error in the launcher's error file. Such early returns Say their
    // reason, which RecordLauncherError takes when no cause is set here.
    cause = RootCause{};
    // Node 0 picks it before it lets the others in, so that whoever gets
    // into the attempt finds it.
    if (!multi_node || o.node_rank == 0) {
      // For a PyTorch program's own rendezvous: its rank 0 listens there.
      StatusOr<int> free_port = store::FreeTcpPort();
      Status s = free_port.status();
      if (s.ok() && run_id.empty()) {
        StatusOr<std::string> fresh = GenerateJobToken();
        s = fresh.status();
        if (s.ok()) run_id = fresh->substr(0, 16);
      }
      if (s.ok() && multi_node) {
        s = client->Set(Key(attempt, "master_port"), std::to_string(*free_port), DeadlineIn(o.store_call_time));
      }
      if (s.ok() && multi_node) {
        s = client->Set(Key(attempt, "run_id"), run_id, DeadlineIn(o.store_call_time));
      }
      if (s.ok() && multi_node && !o.assign_node_rank) {
        s = client->Set(kAttemptKey, std::to_string(attempt), DeadlineIn(o.store_call_time));
      }
      if (!s.ok()) {
        Say(node_name() + ": " + s.message());
        post_stop(attempt, node_name() + ": " + s.message());
        publish_final(attempt, 1);
        return 1;
      }
      torch_port = *free_port;
    }
    if (multi_node && o.assign_node_rank) {
      if (o.node_rank == 0) {
        StatusOr<int> members = FormRound(*client, o, max_nodes, attempt, failures, returning, node_nprocs);
        if (!members.ok()) {
          int code = 1;
          if (members.status().code() != StatusCode::kAborted) {
            Say("node 0: " + members.status().message());
          } else if (InterruptSignal() != 0) {
            code = leave_interrupted(attempt, /*member=*/true, "node 0");
          } else {
            Say(members.status().message());  // a stop, which names its node
          }
          CatchInterrupts(false);
          publish_final(attempt, code);
          return code;
        }
        o.nnodes = *members;
        if (o.min_nodes > 0) {
          Say("the job runs on " + std::to_string(o.nnodes) + (o.nnodes == 1 ? " node" : " nodes") +
              " (--nnodes=" + o.nnodes_spec + ")" +
              (attempt > 0 ? " from restart " + std::to_string(attempt) : ""));
        }
      } else {
        if (previous_rank < 0 && attempt == 0) {
          // A new launcher joins the round node 0 is forming or running.
          const Deadline until = DeadlineIn(o.rdzv_timeout);
          StatusOr<std::string> current = TimedOutError("");
          while (true) {
            current = client->Get(kRoundKey, std::min(until, DeadlineIn(MonitorSlice(o))));
            if (current.ok() || current.status().code() != StatusCode::kTimedOut || Clock::now() >= until) break;
            if (InterruptSignal() != 0) return leave_interrupted(attempt, /*member=*/false, node_name());
          }
          const std::optional<int64_t> round = current.ok() ? ParseInt(*current) : std::nullopt;
          if (!round || *round < 0) {
            Say(node_name() + ": " +
                (current.ok() ? "malformed round '" + *current + "' in the store" : current.status().message()));
            return 1;
          }
          attempt = static_cast<int>(*round);
        }
        // Moves `attempt` on and resets `previous_rank` to -1 when left out.
        StatusOr<JoinResult> joined = JoinRound(*client, o, max_nodes, attempt, previous_rank, node_name());
        if (!joined.ok()) {
          if (joined.status().code() != StatusCode::kAborted) {
            Say(node_name() + ": " + joined.status().message() + serve_note);
            return 1;
          }
          // A launcher of the last round ends the job; a spare (also one
          // left out of the round that runs now) just leaves.
          if (InterruptSignal() != 0) return leave_interrupted(attempt, previous_rank > 0, node_name());
          Say(joined.status().message());  // a stop, which names its node
          return 1;
        }
        if (!joined->seat) {
          if (previous_rank > 0) {
            Say(node_name() + ": node 0 ended the job (exit status " + std::to_string(joined->job_exit) +
                ") instead of restarting it");
          } else {
            Say("launcher: the job ended (exit status " + std::to_string(joined->job_exit) +
                " on node 0) before this launcher got a place in it");
          }
          return joined->job_exit == 0 ? 0 : 1;
        }
        const Seat& seat = *joined->seat;
        attempt = seat.round;
        failures = seat.failures;
        o.node_rank = previous_rank = seat.node_rank;
        o.nnodes = seat.nnodes;
        node_nprocs = seat.nprocs;
        Say((attempt == 0 ? "joined as node " : "restart " + std::to_string(attempt) + ": joined as node ") +
            std::to_string(o.node_rank) + " of " + std::to_string(o.nnodes));
      }
    } else if (multi_node) {
      Status joined = Rendezvous(*client, o, attempt, node_nprocs);
      failures = attempt;  // static restarts are all failure restarts
      if (joined.code() == StatusCode::kAborted) {
        int code = 1;
        if (InterruptSignal() != 0) {
          code = leave_interrupted(attempt, /*member=*/true, "node " + std::to_string(o.node_rank));
        } else {
          Say(joined.message());  // a stop, which names its node
        }
        leave_rendezvous(attempt);
        return code;
      }
      if (!joined.ok()) {
        Say("node " + std::to_string(o.node_rank) + ": " + joined.message());
        // A node rank given twice is bad input, found before anything ran.
        return joined.code() == StatusCode::kInvalidArgument && !started ? 2 : 1;
      }
    }
    // Ranks by node order, as torchrun assigns them: the nodes may run
    // different numbers of workers (node_nprocs: c10d, this round's;
    // static, the job's).
    int world_size = o.nnodes * o.nproc_per_node;
    int first_rank = o.node_rank * o.nproc_per_node;  // this node's first worker's
    if (multi_node) {
      world_size = first_rank = 0;
      for (int node = 0; node < o.nnodes; ++node) {
        if (node < o.node_rank) first_rank += node_nprocs[node];
        world_size += node_nprocs[node];
      }
    }

    // While the workers run, a watcher thread follows the other nodes on a
    // connection of its own (it parks in Get); closing that connection wakes
    // it as soon as the workers are done. Connected before the workers start,
    // so that a node 0 dying early is seen as such.
    std::unique_ptr<store::TcpStoreClient> watch_client;
    if (multi_node) {
      auto connected = store::TcpStoreClient::Connect(o.master_addr, port, token,
                                                      DeadlineIn(o.store_call_time));
      if (!connected.ok()) {
        const std::string reason = "node " + std::to_string(o.node_rank) + ": " + connected.status().message();
        Say(reason);
        post_stop(attempt, reason);  // if the main connection still works: do not wait for this node
        return 1;
      }
      watch_client = std::move(connected).value();
    }
    if (multi_node && o.node_rank != 0) {
      // Node 0 wrote it before it formed this attempt.
      StatusOr<std::optional<std::string>> written =
          client->TryGet(Key(attempt, "master_port"), DeadlineIn(o.store_call_time));
      std::optional<int64_t> value;
      if (written.ok() && written->has_value()) value = ParseInt(**written);
      if (!value || *value < 1 || *value > 65535) {
        const std::string reason =
            "node " + std::to_string(o.node_rank) + ": " +
            (!written.ok() ? written.status().message()
                           : written->has_value() ? "malformed MASTER_PORT '" + **written + "' in the store"
                                                  : std::string("node 0 gave no MASTER_PORT for this attempt"));
        Say(reason);
        post_stop(attempt, reason);
        return 1;
      }
      torch_port = static_cast<int>(*value);
      StatusOr<std::optional<std::string>> run = client->TryGet(Key(attempt, "run_id"), DeadlineIn(o.store_call_time));
      if (!run.ok() || !run->has_value() || (*run)->empty()) {
        const std::string reason = "node " + std::to_string(o.node_rank) + ": " +
                                   (!run.ok() ? run.status().message() : "node 0 gave no run id for this attempt");
        Say(reason);
        post_stop(attempt, reason);
        return 1;
      }
      run_id = **run;
    }
    std::vector<WorkerSpec> specs;
    for (int local = 0; local < o.nproc_per_node; ++local) {
      LaunchEnv env;
      env.rank = first_rank + local;
      env.world_size = world_size;
      env.local_rank = local;
      env.local_world_size = o.nproc_per_node;
      env.group_rank = o.node_rank;
      env.master_addr = o.master_addr;
      env.master_port = port;
      env.restart_count = attempt;
      env.job_token = token;
      env.store_hosted_by_launcher = true;
      WorkerSpec spec;
      spec.rank = env.rank;
      spec.log_name = std::to_string(local);  // torchrun's attempt_K/<local rank>/
      // As torchrun's logs specs: a teed stream is also redirected, to its
      // file; a redirected one that is not teed leaves the terminal.
      const int teed = o.tee.For(local);
      const int redirected = o.redirects.For(local) | teed;
      spec.logged_streams = redirected;
      spec.shown_streams = kBothStreams & (~redirected | teed);
      spec.program = *program;
      spec.argv.push_back(o.command[0]);
      if (!o.line_prefix_template.empty()) spec.line_prefix = LinePrefix(o.line_prefix_template, env.rank, local, o.role);
      for (size_t a = 1; a < o.command.size(); ++a) spec.argv.push_back(SubstituteLocalRank(o.command[a], local));
      spec.env = ToEnvironment(env);
      // The store is at DDP_STORE_ADDR:DDP_STORE_PORT; MASTER_PORT is left to
      // a PyTorch program, whose rank 0 listens there (as under torchrun with
      // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
      for (auto& [name, value] : spec.env) {
        if (name == kEnvMasterPort) value = std::to_string(torch_port);
        if (name == kEnvLocalRank && !o.virtual_devices.empty()) value = "0";
      }
      if (!o.virtual_devices.empty()) spec.env.emplace_back("CUDA_VISIBLE_DEVICES", o.virtual_devices[local]);
      spec.env.emplace_back(kEnvTorchAgentStore, "False");
      // torchrun's other variables, for programs written against it.
      spec.env.emplace_back("GROUP_WORLD_SIZE", std::to_string(o.nnodes));
      spec.env.emplace_back("ROLE_NAME", o.role);
      spec.env.emplace_back("ROLE_RANK", std::to_string(env.rank));
      spec.env.emplace_back("ROLE_WORLD_SIZE", std::to_string(world_size));
      spec.env.emplace_back("TORCHELASTIC_RESTART_COUNT", std::to_string(failures));
      spec.env.emplace_back("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
      // torchrun's --standalone makes up a run id (a uuid4) for every run,
      // whatever --rdzv_id says; otherwise its --rdzv_id defaults to "none".
      spec.env.emplace_back("TORCHELASTIC_RUN_ID", o.standalone          ? run_id
                                                   : !o.rdzv_id.empty() ? o.rdzv_id
                                                                        : "none");
      spec.env.emplace_back(kEnvRunId, run_id);
      if (omp_default) spec.env.emplace_back("OMP_NUM_THREADS", "1");
      if (nccl_async_default) spec.env.emplace_back("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
      if (python_unbuffered_default) spec.env.emplace_back("PYTHONUNBUFFERED", "1");
      specs.push_back(std::move(spec));
    }
    SpawnOptions spawn;
    spawn.grace = o.grace;
    spawn.exec_timeout = o.exec_timeout;
    // As under torchrun, whose workers share its process group: a worker
    // may read the terminal (pdb, input()) when ddprun runs in its
    // foreground; Ctrl-C there still stops the job, Ctrl-Z stops it as a
    // shell's job.
    spawn.share_terminal = true;
    spawn.on_notice = [&o](const std::string& line) { Say("node " + std::to_string(o.node_rank) + ": " + line); };
    // torchrun's --log_dir alone keeps the terminal; -r 3 sends the output
    // to the files instead, -t 3 to both.
    spawn.output.to_terminal = true;  // per stream: WorkerSpec::shown_streams
    spawn.output.log_files = log_files;
    spawn.output.prefix = o.prefix && o.nproc_per_node > 1;
    for (int local : o.local_ranks_filter) {
      spawn.output.terminal_ranks.push_back(first_rank + local);
    }
    spawn.output.log_dir = o.log_dir;
    spawn.output.log_name_prefix = "attempt_" + std::to_string(attempt) + "/";
    if (multi_node) {
      // Before the signal reaches the workers: once they end, the workers of
      // the other nodes fail within milliseconds, and the stop must already
      // be there when their launchers decide whether to restart.
      spawn.on_interrupt = [&post_stop, attempt, node = "node " + std::to_string(o.node_rank)](int signo) {
        post_stop(attempt, node + ": interrupted by " + SignalName(signo));
      };
    }
    // A signal caught since the last look (CatchInterrupts) would not reach
    // the group, which forwards only those that come once it exists.
    // The round is formed: leaving here, node 0 still tells the launchers
    // waiting for the next round how the job ended, as after the workers.
    if (const int signo = InterruptSignal(); signo != 0 && multi_node) {
      const int code = leave_interrupted(attempt, /*member=*/true, "node " + std::to_string(o.node_rank));
      farewell(attempt, code);
      return code;
    } else if (signo != 0) {
      // A single node: no one else to tell; the job ends here.
      cause.reason = "interrupted by " + SignalName(signo) +
                     (attempt == 0 ? std::string(" before the workers started")
                                   : " before restart " + std::to_string(attempt) + " started");
      Say(cause.reason);
      CatchInterrupts(false);
      return 128 + signo;
    }
    StatusOr<std::unique_ptr<WorkerGroup>> group = WorkerGroup::Start(std::move(specs), spawn);
    if (!group.ok()) {
      // Only a wrong program or log folder is bad input (exit 2); a start
      // that ran out of descriptors, processes or memory fails as a job
      // does (exit 1), with a line that tells the two apart.
      const Status& failed = group.status();
      std::string why = failed.code() == StatusCode::kResourceExhausted
                            ? "the workers could not start for lack of resources (not bad input): " +
                                  failed.message()
                            : failed.message();
      // After a failure whose line said "restarting the job": say that it
      // is the restart, with its attempt_K folder's number, that failed.
      if (started) why = "the restart (attempt " + std::to_string(attempt) + ") could not start the workers: " + why;
      Say(why);
      post_stop(attempt, "node " + std::to_string(o.node_rank) + ": " + why);
      const int code = !started && failed.code() == StatusCode::kInvalidArgument ? 2 : 1;
      if (multi_node) farewell(attempt, code);
      return code;
    }

    const bool admit_waiting = o.assign_node_rank && o.min_nodes > 0 && o.nnodes < max_nodes;
    started = true;
    std::atomic<bool> stop_watching{false};
    std::thread watcher;
    if (multi_node) {
      watcher = std::thread([&, attempt] {
        NodeMonitor monitor(*watch_client, o, attempt, /*admit_waiting=*/admit_waiting);
        while (!stop_watching.load()) {
          if (std::optional<FailureNotice> notice = monitor.Poll(MonitorSlice(o))) {
            if (!stop_watching.load()) (*group)->RequestStop(notice->reason);
            return;
          }
        }
      });
    }
    const Deadline deadline = o.max_run_time.count() > 0 ? Clock::now() + o.max_run_time
                                                          : Deadline::max();
    GroupResult result = (*group)->Wait(deadline);
    if (result.outcome == GroupOutcome::kTimedOut) {
      // Wait's own words say "the deadline": name the flag that set it.
      result.reason = "--max_run_time (" + std::to_string(o.max_run_time.count()) + " ms) ran out: " + result.reason;
    }
    cause.worker = result.first_error;
    stop_watching = true;
    if (watch_client) watch_client->Close();
    if (watcher.joinable()) watcher.join();
    group->reset();
    if (result.output_dropped > 0) {
      Say("dropped " + std::to_string(result.output_dropped) +
          " bytes of worker output: this launcher's stdout or stderr took nothing for 2 s" +
          (!log_files                    ? ""
           : result.log_failures.empty() ? " (the streams written to log files are whole there)"
                                         : " (the streams written to log files are whole there, but for the log "
                                           "files that stopped, named below)"));
    }
    for (const std::string& line : result.log_failures) Say(line);
    if (const int signo = InterruptSignal(); signo != 0 && result.outcome != GroupOutcome::kInterrupted) {
      // The signal came after Wait's last look, while the group was being
      // destroyed: it ends this launcher all the same.
      result.reason = (result.reason.empty() ? "" : result.reason + "; ") + "interrupted by " +
                      SignalName(signo);
      result.outcome = GroupOutcome::kInterrupted;
      result.signal = signo;
    }

    // Bookkeeping in the store after the workers are done. A call that times
    // out or finds the store gone means it cannot be reached (node 0 died or
    // the network is cut): skip the rest, and do not restart.
    const milliseconds call_time = std::min<milliseconds>(o.store_call_time, o.node_timeout);
    bool store_reachable = multi_node;
    auto note = [&](const Status& status) {
      if (status.code() == StatusCode::kTimedOut || status.code() == StatusCode::kUnavailable) {
        store_reachable = false;
      }
    };

    AttemptOutcome outcome;
    const std::string node = "node " + std::to_string(o.node_rank);
    switch (result.outcome) {
      case GroupOutcome::kSucceeded:
        outcome.succeeded = true;
        outcome.exit_code = 0;
        break;
      case GroupOutcome::kWorkerFailed:
      case GroupOutcome::kTimedOut:
      case GroupOutcome::kInterrupted:
      case GroupOutcome::kMonitorFailed:
        // An interrupted launcher stops the whole job: no restart. Nor does
        // one that could not watch its workers (a fault of this launcher),
        // nor --max_run_time running out (a limit, not a failure).
        outcome.restartable = result.outcome != GroupOutcome::kInterrupted &&
                              result.outcome != GroupOutcome::kMonitorFailed &&
                              result.outcome != GroupOutcome::kTimedOut;
        // A failed worker makes the launcher exit 1, as torchrun does (its
        // code is in the reason line and the error file): passed through,
        // a worker's 2 would read as ddprun's bad input and its 137 as
        // the launcher killed. Interrupted stays 128 + the signal.
        outcome.exit_code = result.outcome == GroupOutcome::kWorkerFailed ? 1 : result.ExitCode();
        outcome.reason = (multi_node ? node + ": " : "") + result.reason;
        // Normally posted already, as the signal came (see on_interrupt).
        if (store_reachable && !outcome.restartable) post_stop(attempt, outcome.reason);
        if (store_reachable) note(PostFailure(*client, o, attempt, outcome.restartable, outcome.reason));
        break;
      case GroupOutcome::kStopped: {
        // Another node failed (or the store went away): report its reason.
        outcome.exit_code = 1;
        outcome.reason = result.reason;
        std::optional<FailureNotice> notice;
        if (store_reachable) {
          auto posted = client->TryGet(Key(attempt, "failure"), DeadlineIn(call_time));
          note(posted.status());
          if (posted.ok() && posted->has_value()) notice = DecodeFailure(**posted);
        }
        outcome.restartable = notice && notice->restartable;
        outcome.membership = notice && notice->membership;
        if (notice) outcome.reason = notice->reason;
        break;
      }
    }

    if (outcome.succeeded && multi_node) {
      // Done here; the attempt succeeds when every node is done, and fails if
      // any node fails meanwhile.
      Status s = client->Set(Key(attempt, "done/" + std::to_string(o.node_rank)), "1",
                             DeadlineIn(call_time));
      NodeMonitor monitor(*client, o, attempt);
      std::vector<std::string> done_keys;
      for (int n = 0; n < o.nnodes; ++n) done_keys.push_back(Key(attempt, "done/" + std::to_string(n)));
      while (s.ok()) {
        Status all_done = client->Wait(done_keys, DeadlineIn(MonitorSlice(o)));
        if (all_done.ok()) break;
        if (all_done.code() != StatusCode::kTimedOut) {
          s = all_done;
          break;
        }
        if (std::optional<FailureNotice> notice = monitor.Check()) {
          outcome = AttemptOutcome{false, notice->restartable, 1, notice->reason, notice->membership};
          break;
        }
        if (const int signo = InterruptSignal(); signo != 0) {
          // Caught (CatchInterrupts) while the other nodes still work.
          result.outcome = GroupOutcome::kInterrupted;
          result.signal = signo;
          outcome = AttemptOutcome{false, false, 128 + signo,
                                   node + ": interrupted by " + SignalName(signo) +
                                       " while waiting for the other nodes to finish"};
          post_stop(attempt, outcome.reason);
          break;
        }
      }
      if (!s.ok()) {
        note(s);
        outcome = AttemptOutcome{false, false, 1, "lost the rendezvous store: " + s.message()};
      }
    }

    exit_code = outcome.exit_code;
    // Every launcher decides from the notice posted first, so that all
    // agree (a worker stopped with the others may still exit non-zero),
    // unless a launcher stopped the job (PostStop); an interrupted
    // launcher stops whatever the others do.
    const bool interrupted = result.outcome == GroupOutcome::kInterrupted;
    std::optional<std::string> stop;
    if (!outcome.succeeded && store_reachable && !interrupted) stop = PostedStop(*client, o, attempt);
    if (!outcome.succeeded && store_reachable && !interrupted && !stop) {
      auto posted = client->TryGet(Key(attempt, "failure"), DeadlineIn(call_time));
      note(posted.status());
      if (posted.ok() && posted->has_value()) {
        if (std::optional<FailureNotice> first = DecodeFailure(**posted)) {
          outcome.restartable = first->restartable;
          outcome.membership = first->membership;
        }
      }
    }
    const bool restart = !outcome.succeeded && outcome.restartable && !stop &&
                         (outcome.membership || failures < o.max_restarts) &&
                         (store_reachable || !multi_node);
    if (!outcome.succeeded) {
      std::string why = outcome.reason;
      if (stop) {
        why = (outcome.reason == *stop ? *stop : outcome.reason + "; " + *stop) +
              " (the job stops without a restart)";
      } else if (restart && outcome.membership) {
        why += "; restarting the workers to take them in (not counted against --max_restarts)";
      } else if (restart) {
        why += "; restarting the job (restart " + std::to_string(failures + 1) + " of " +
               std::to_string(o.max_restarts) + ")";
      }
      cause.reason = why;
      Say(why);
    }
    if (restart) {
      if (!outcome.membership) ++failures;
      if (o.node_rank == 0 && o.assign_node_rank) {
        // The nodes declared dead will not be back.
        returning = 0;
        for (int n = 1; n < o.nnodes; ++n) {
          auto dead = client->TryGet(Key(attempt, "dead/" + std::to_string(n)), DeadlineIn(call_time));
          if (dead.ok() && !dead->has_value()) ++returning;
        }
      }
      continue;
    }
    CatchInterrupts(false);
    if (store_reachable) farewell(attempt, exit_code);
    break;
  }
  if (server) server->Stop();
  return exit_code;
}

}  // namespace

}  // namespace ddp::transport::launch
