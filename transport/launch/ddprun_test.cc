// ddprun as a user runs it: the real binary, real worker processes.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transport/launch/launch_test_util.h"

namespace ddp::transport::launch {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;
using testing::CountLines;
using testing::RunProgram;

// The end of the start-up line naming a run's files: a worker's error.json
// is there only if the worker writes one (ddprun writes none for it).
constexpr char kIfWritten[] = " (error.json only if the worker writes its error there: it is its "
                              "TORCHELASTIC_ERROR_FILE)\n";

std::string Ddprun() { return testing::Runfile("transport/launch/ddprun"); }
std::string Worker() { return testing::Runfile("transport/launch/test_worker"); }

std::vector<std::string> Cmd(std::vector<std::string> flags, std::vector<std::string> worker_flags) {
  std::vector<std::string> argv = {Ddprun()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(Worker());
  argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
  return argv;
}

// Pids the workers wrote to `dir` (rank0.restart0.pid, ...), waiting for
// `count` of them. Workers write them first thing; tests that make a worker
// fail pass --store so that the failure comes after every rank wrote its pid.
std::vector<pid_t> WorkerPids(const std::string& dir, int count, int restart = 0) {
  std::vector<pid_t> pids;
  for (int r = 0; r < count; ++r) {
    pids.push_back(testing::ReadPidFile(
        dir + "/rank" + std::to_string(r) + ".restart" + std::to_string(restart) + ".pid", 10s));
  }
  return pids;
}

void ExpectAllGone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(testing::GoneWithin(pid, 5s)) << "worker " << pid << " is still running";
  }
}

std::string ReadFile(const std::string& path) {
  std::stringstream s;
  s << std::ifstream(path).rdbuf();
  return s.str();
}

// The folders a run made in --log_dir `dir` (<rdzv_id>_<random>), sorted.
std::vector<std::string> RunDirs(const std::string& dir) {
  std::vector<std::string> found;
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* entry = readdir(d)) {
      if (entry->d_name[0] != '.') found.push_back(dir + "/" + entry->d_name);
    }
    closedir(d);
  }
  std::sort(found.begin(), found.end());
  return found;
}

// The one run's folder in --log_dir `dir`; "" (and a failure) unless there
// is exactly one.
std::string RunDir(const std::string& dir) {
  const std::vector<std::string> found = RunDirs(dir);
  EXPECT_EQ(found.size(), 1u) << dir;
  return found.size() == 1 ? found[0] : "";
}

TEST(DdprunTest, StandaloneWorkersGetTheLaunchEnvironment) {
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=4"}, {"--store", "--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < 4; ++r) {
    const std::string rs = std::to_string(r);
    EXPECT_THAT(run.output, HasSubstr("[" + rs + "] rank " + rs + "/4 local " + rs +
                                      "/4 group 0 restart 0 master 127.0.0.1:"));
    EXPECT_THAT(run.output, HasSubstr("[" + rs + "] rank " + rs + " met 4 ranks"));
  }
  EXPECT_EQ(CountLines(run.output, "store launcher token_len 32"), 4) << run.output;
}

// torchrun's single-node line with port 0: the store listens on a free port,
// which the workers are given.
TEST(DdprunTest, EndpointPortZeroPicksAFreePort) {
  const auto run = RunProgram(Cmd({"--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
                                   "--nproc-per-node=2"},
                                  {"--store", "--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(CountLines(run.output, "met 2 ranks"), 2) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("rank 0/2 local 0/2 group 0 restart 0 master localhost:[1-9][0-9]* "));
  EXPECT_THAT(run.output, Not(HasSubstr("master localhost:0 ")));
}

// The workers' MASTER_ADDR:MASTER_PORT is left to a PyTorch program's own
// rendezvous (its rank 0 listens there; TORCHELASTIC_USE_AGENT_STORE=False):
// the store is at DDP_STORE_ADDR:DDP_STORE_PORT, and both work in one job.
TEST(DdprunTest, MasterPortIsLeftToPyTorchsOwnRendezvous) {
  auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=3"}, {"--store", "--meet_on_master_port"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  // Three through the store, then rank 0 on MASTER_PORT.
  EXPECT_EQ(CountLines(run.output, "met 3 ranks"), 4) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 met 3 ranks on MASTER_PORT\n"));
  run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
                    "echo ports $MASTER_ADDR $TORCHELASTIC_USE_AGENT_STORE $DDP_STORE_ADDR "
                    "$((MASTER_PORT != DDP_STORE_PORT))"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] ports 127.0.0.1 False 127.0.0.1 1\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] ports 127.0.0.1 False 127.0.0.1 1\n"));
}

// As torchrun's, the workers read the launcher's stdin: `echo hello |
// ddprun --nproc_per_node=1 prog` hands the line to the worker (pdb in a
// lone worker takes its commands so). They got /dev/null.
TEST(DdprunTest, WorkersReadTheLaunchersStdin) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  const int saved = dup(STDIN_FILENO);
  dup2(p[0], STDIN_FILENO);  // not close-on-exec: ddprun inherits it
  close(p[0]);
  const std::string text = "hello\n";
  const bool written = write(p[1], text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(p[1]);
  const auto run = written ? RunProgram({Ddprun(), "--standalone", "--nproc_per_node=1", "/bin/sh", "-c",
                                         "read line; echo \"got '$line'\""})
                           : testing::ProgramRun{};
  if (saved >= 0) {
    dup2(saved, STDIN_FILENO);
    close(saved);
  } else {
    close(STDIN_FILENO);
  }
  ASSERT_TRUE(written);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("got 'hello'\n"));
}

// As torchrun: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless the launcher's
// environment sets it, which then reaches the workers as it is.
TEST(DdprunTest, WorkersGetTorchNcclAsyncErrorHandlingAsUnderTorchrun) {
  const std::vector<std::string> argv = {Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
                                         "echo nccl=${TORCH_NCCL_ASYNC_ERROR_HANDLING-unset}"};
  unsetenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");  // the test's own environment, which the launcher gets
  auto run = RunProgram(argv);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] nccl=1\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] nccl=1\n"));
  run = RunProgram(argv, {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] nccl=3\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] nccl=3\n"));
}

// Programs written for torchrun find its other variables too, and several
// workers per node get one OpenMP thread each unless OMP_NUM_THREADS is set.
TEST(DdprunTest, WorkersGetTorchrunsOtherVariables) {
  const std::string print =
      "echo vars $GROUP_WORLD_SIZE $ROLE_NAME $ROLE_RANK $ROLE_WORLD_SIZE $TORCHELASTIC_RESTART_COUNT "
      "$TORCHELASTIC_MAX_RESTARTS $([ \"$TORCHELASTIC_RUN_ID\" = \"$DDP_RUN_ID\" ] && echo run-id || "
      "echo $TORCHELASTIC_RUN_ID) omp=$OMP_NUM_THREADS";
  auto run = RunProgram({Ddprun(), "--nproc_per_node=2", "--master_port=0", "--max_restarts=3", "--rdzv_id=j9",
                         "/bin/sh", "-c", print});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] vars 1 default 0 2 0 3 j9 omp=1\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] vars 1 default 1 2 0 3 j9 omp=1\n"));
  run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c", print},
                   {{"OMP_NUM_THREADS", "4"}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // torchrun's --standalone makes up a run id for each run (a uuid4): the
  // workers' TORCHELASTIC_RUN_ID is the run's DDP_RUN_ID, not "none".
  EXPECT_THAT(run.output, HasSubstr("[1] vars 1 default 1 2 0 0 run-id omp=4\n"));
  // It does so over --rdzv_id (and PET_RDZV_ID) too, and says so.
  for (const bool from_env : {false, true}) {
    std::vector<std::string> argv = {Ddprun(), "--standalone", "--nproc_per_node=2"};
    if (!from_env) argv.push_back("--rdzv_id=j9");
    for (const std::string a : {"/bin/sh", "-c"}) argv.push_back(a);
    argv.push_back(print);
    run = RunProgram(argv, from_env ? std::vector<std::pair<std::string, std::string>>{{"PET_RDZV_ID", "j9"}}
                                    : std::vector<std::pair<std::string, std::string>>{});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("[1] vars 1 default 1 2 0 0 run-id omp=1\n"));
    // The note names where the id came from (it said --rdzv_id=j9 for both).
    EXPECT_THAT(run.output, HasSubstr(std::string("ddprun: note: ") + (from_env ? "PET_RDZV_ID='j9'" : "--rdzv_id=j9") +
                                      " is ignored: --standalone makes up a run id for each run, as torchrun's "
                                      "does\n"));
  }
  run = RunProgram({Ddprun(), "--nproc_per_node=1", "--master_port=0", "/bin/sh", "-c", print});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("vars 1 default 0 1 0 0 none omp=\n"));
  // --role names the role; flags without a meaning here get a note.
  run = RunProgram({Ddprun(), "--standalone", "--role=trainer", "--logs-specs=x", "--monitor_interval=1",
                    "--start_method=spawn", "/bin/sh", "-c", print});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("vars 1 trainer 0 1 0 0 run-id omp=\n"));
  EXPECT_THAT(run.output, HasSubstr("ddprun: note: --logs_specs=x is ignored: ddprun writes torchrun's default "
                                    "layout, --log_dir/<rdzv_id>_<random>/attempt_K/LOCAL_RANK/stdout.log, "
                                    "stderr.log and error.json\n"));
}

// torchrun's --virtual_local_rank: every worker gets LOCAL_RANK=0 and one
// device, its local rank's entry of CUDA_VISIBLE_DEVICES (or its local rank
// when that is not set), which it then sees as device 0. It was refused as
// an unknown flag.
TEST(DdprunTest, VirtualLocalRankGivesEachWorkerOneDevice) {
  const std::vector<std::string> argv = {Ddprun(), "--standalone", "--nproc_per_node=2", "--virtual-local-rank",
                                         "/bin/sh", "-c",
                                         "echo \"rank $RANK local $LOCAL_RANK/$LOCAL_WORLD_SIZE "
                                         "devices ${CUDA_VISIBLE_DEVICES-unset}\""};
  auto run = RunProgram(argv, {{"CUDA_VISIBLE_DEVICES", "3, 5,6"}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 local 0/2 devices 3\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 local 0/2 devices 5\n"));
  unsetenv("CUDA_VISIBLE_DEVICES");  // the test's own environment, which the launcher gets
  run = RunProgram(argv);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 local 0/2 devices 0\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 local 0/2 devices 1\n"));
  // Without it, LOCAL_RANK is the local rank and the devices are left alone.
  run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
                    "echo \"rank $RANK local $LOCAL_RANK devices ${CUDA_VISIBLE_DEVICES-unset}\""},
                   {{"CUDA_VISIBLE_DEVICES", "3,5"}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 local 1 devices 3,5\n"));
  // Fewer devices than workers: refused before anything starts.
  run = RunProgram(argv, {{"CUDA_VISIBLE_DEVICES", "7"}});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_EQ(run.output,
            "ddprun: --virtual_local_rank gives each worker one device of CUDA_VISIBLE_DEVICES='7', which "
            "names 1, fewer than --nproc_per_node=2\n");
}

// Worker output that passes through ddprun (prefixes, log files, a ranks
// filter) reaches Python as a pipe, which it buffers in 8 KiB blocks: a
// PyTorch program's print() lines came minutes late, and were lost with a
// killed worker. Under torchrun they reach the terminal line by line.
// ddprun sets PYTHONUNBUFFERED=1 then, unless its environment sets it.
TEST(DdprunTest, PythonOutputThroughTheLauncherIsUnbuffered) {
  unsetenv("PYTHONUNBUFFERED");  // the test's own environment, which the launcher gets
  const std::vector<std::string> print = {"/bin/sh", "-c", "echo unbuffered=${PYTHONUNBUFFERED-unset}"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), Ddprun());
    flags.insert(flags.end(), print.begin(), print.end());
    return flags;
  };
  auto run = RunProgram(with({"--standalone", "--nproc_per_node=2"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] unbuffered=1\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] unbuffered=1\n"));
  const std::string dir = testing::MakeTempDir("ddprun_unbuffered");
  run = RunProgram(with({"--standalone", "--log_dir=" + dir, "--tee"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("unbuffered=1\n"));
  // One worker, nothing in between: it writes to the launcher's own output,
  // as under torchrun, and Python buffers as it would there.
  run = RunProgram(with({"--standalone"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("unbuffered=unset\n"));
  run = RunProgram(with({"--standalone", "--nproc_per_node=2", "--no_prefix"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(CountLines(run.output, "unbuffered=unset"), 2) << run.output;
  // The launcher's environment decides when it says anything.
  run = RunProgram(with({"--standalone", "--nproc_per_node=2"}), {{"PYTHONUNBUFFERED", ""}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(CountLines(run.output, "unbuffered=\n"), 0);
  EXPECT_THAT(run.output, HasSubstr("[1] unbuffered=\n"));
}

// torchrun's argument macro: ${local_rank} (or $local_rank) in PROGRAM's
// arguments is each worker's local rank; a shell's $$ is left alone.
TEST(DdprunTest, LocalRankMacroInArguments) {
  const auto run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
                               "echo \"args $1 $2 $3 pid=$(($$ > 0))\"", "sh", "--device=cuda:${local_rank}",
                               "$local_rank", "$local_ranks"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] args --device=cuda:0 0 $local_ranks pid=1\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] args --device=cuda:1 1 $local_ranks pid=1\n"));
}

// torchtitan's and torchchat's launch line: torchrun's --tee 3 without
// --log_dir (and --redirects 3) log into a fresh $TMPDIR/torchelastic_*
// folder, as torchrun does, instead of being refused.
TEST(DdprunTest, TeeWithoutLogDirLogsIntoATemporaryFolder) {
  const std::string tmp = testing::MakeTempDir("ddprun_tee_tmp");
  auto run = RunProgram({Ddprun(), "--nproc-per-node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                         "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "/bin/sh", "-c",
                         "echo \"rank $RANK role $ROLE_NAME\""},
                        {{"TMPDIR", tmp}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 role rank\n"));
  EXPECT_THAT(run.output, Not(HasSubstr("[1] ")));
  const std::string base = RunDir(tmp);
  EXPECT_THAT(base, ContainsRegex("/torchelastic_[A-Za-z0-9]{6}$"));
  const std::string run_dir = RunDir(base);
  EXPECT_THAT(run.output, HasSubstr("ddprun: this run's logs: " + run_dir +
                                    "/attempt_K/LOCAL_RANK/stdout.log, stderr.log and error.json" + kIfWritten));
  EXPECT_EQ(ReadFile(run_dir + "/attempt_0/0/stdout.log"), "rank 0 role rank\n");
  EXPECT_EQ(ReadFile(run_dir + "/attempt_0/1/stdout.log"), "rank 1 role rank\n");

  // --redirects 3: into the files only.
  const std::string tmp2 = testing::MakeTempDir("ddprun_redirects_tmp");
  run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "--redirects", "3", "/bin/sh", "-c",
                    "echo \"rank $RANK\""},
                   {{"TMPDIR", tmp2}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("rank 1\n")));
  EXPECT_EQ(ReadFile(RunDir(RunDir(tmp2)) + "/attempt_0/1/stdout.log"), "rank 1\n");
}

TEST(DdprunTest, WorkerExitCodeStopsTheGroupAndNamesTheRank) {
  const std::string dir = testing::MakeTempDir("ddprun_exit");
  const auto start = Clock::now();
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=4"},
                                  {"--store", "--exit_code=3:7", "--sleep_ms=30000", "--pid_dir=" + dir}));
  EXPECT_LT(Clock::now() - start, 10s);
  // torchrun's 1, not the worker's 7 (which the line names).
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex(
                              "ddprun: rank 3 \\(pid [0-9]+\\) exited with code 7; stopping the other workers\n"));
  ExpectAllGone(WorkerPids(dir, 4));
}

// A worker's 2 is not ddprun's 2 (bad input, nothing started): ddprun
// exits 1, as torchrun does, and the line names the worker's code.
TEST(DdprunTest, AWorkersExitCodeIsNotPassedThrough) {
  const auto run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
                               "[ \"$RANK\" = 1 ] && exit 2; sleep 30"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("ddprun: rank 1 \\(pid [0-9]+\\) exited with code 2; stopping the other "
                                        "workers\n"));
}

// torchrun's --shutdown_timeout (and TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which
// its launcher reads when no flag is given) is the wait between SIGTERM and
// SIGKILL. The flag was refused as unknown, and the variable ignored. Here
// each gives 1 s, less than rank 1's save on SIGTERM (6 s) and than the
// default grace (30 s, in which the save would finish): the save is cut
// short only when the value is used.
TEST(DdprunTest, TorchrunsShutdownTimeoutIsTheGracePeriod) {
  // Rank 1 saves for 6 s on SIGTERM; rank 0 fails once rank 1 is ready.
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then trap ': > \"$1/saving\"; sleep 6; echo saved > \"$1/saved\"; exit 0' TERM; "
      ": > \"$1/ready\"; while :; do sleep 0.1; done; fi; "
      "i=0; while [ ! -e \"$1/ready\" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i + 1)); done; exit 1";
  // The flag's run and the variable's run at once.
  std::unique_ptr<WorkerGroup> groups[2];
  std::string dirs[2];
  for (const bool from_env : {false, true}) {
    const std::string dir = testing::MakeTempDir(from_env ? "ddprun_shutdown_env" : "ddprun_shutdown_flag");
    std::vector<std::string> argv = {Ddprun(), "--standalone", "--nproc_per_node=2"};
    if (!from_env) argv.push_back("--shutdown-timeout=1");
    for (const std::string a : {"/bin/sh", "-c", script.c_str(), "sh"}) argv.push_back(a);
    argv.push_back(dir);
    auto group = testing::StartProgram(argv, from_env ? std::vector<std::pair<std::string, std::string>>{
                                                            {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1"}}
                                                      : std::vector<std::pair<std::string, std::string>>{});
    ASSERT_TRUE(group.ok()) << group.status();
    groups[from_env] = std::move(*group);
    dirs[from_env] = dir;
  }
  for (const bool from_env : {false, true}) {
    const std::string& dir = dirs[from_env];
    const auto run = testing::WaitProgram(*groups[from_env], 30s);
    const std::string which = from_env ? "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" : "--shutdown-timeout";
    EXPECT_EQ(run.exit_code, 1) << which << "\n" << run.output;
    EXPECT_THAT(run.output, ContainsRegex("ddprun: rank 0 \\(pid [0-9]+\\) exited with code 1"));
    EXPECT_EQ(access((dir + "/saving").c_str(), F_OK), 0) << which << ": rank 1 got no SIGTERM\n" << run.output;
    EXPECT_EQ(ReadFile(dir + "/saved"), "") << which << ": the save outlived the grace\n" << run.output;
  }
}

TEST(DdprunTest, WorkerKilledBySignalStopsTheGroupAndNamesTheSignal) {
  const std::string dir = testing::MakeTempDir("ddprun_signal");
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=3"},
                                  {"--store", "--signal=0:9", "--sleep_ms=30000", "--pid_dir=" + dir}));
  // 1: 128 + 9 would read as the launcher killed.
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("ddprun: rank 0 \\(pid [0-9]+\\) was killed by signal 9 "
                                        "\\(SIGKILL\\); stopping the other workers\n"));
  ExpectAllGone(WorkerPids(dir, 3));
}

TEST(DdprunTest, MaxRestartsRestartsTheGroupThenSucceeds) {
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=1"},
                                  {"--store", "--print_env", "--fail_before_restart=1"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 1 fails on attempt 0"));
  EXPECT_THAT(run.output, ContainsRegex("ddprun: rank 1 \\(pid [0-9]+\\) exited with code 1; "
                                        "stopping the other workers; restarting the job "
                                        "\\(restart 1 of 1\\)"));
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0/2 local 0/2 group 0 restart 1"));
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1/2 local 1/2 group 0 restart 1"));
  EXPECT_EQ(CountLines(run.output, "met 2 ranks"), 2) << run.output;
}

// DDP_RUN_ID: one value for every worker of a run, through its restarts,
// and another for the next run with the same token (a program's checkpoint
// names the run it belongs to: the token alone repeats across runs).
TEST(DdprunTest, RunIdIsTheRunsThroughRestartsAndNotTheNextRuns) {
  auto ids = [](const testing::ProgramRun& run) {
    std::set<std::string> seen;
    std::istringstream lines(run.output);
    for (std::string line; std::getline(lines, line);) {
      const size_t at = line.find("run_id ");
      if (at != std::string::npos) seen.insert(line.substr(at + 7));
    }
    return seen;
  };
  const auto first = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=1"},
                                    {"--store", "--print_env", "--fail_before_restart=1"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Rank 1 on both attempts and rank 0 on the second at least: rank 1's
  // failure can stop rank 0's first attempt before it prints (seen on a
  // busy machine).
  EXPECT_GE(CountLines(first.output, " run_id "), 3) << first.output;
  EXPECT_EQ(CountLines(first.output, "[1] rank 1 run_id "), 2) << first.output;
  const std::set<std::string> first_ids = ids(first);
  ASSERT_EQ(first_ids.size(), 1u) << first.output;
  EXPECT_EQ(first_ids.begin()->size(), 16u) << first.output;
  const auto second = RunProgram(Cmd({"--standalone", "--nproc_per_node=2"}, {"--store", "--print_env"}));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const std::set<std::string> second_ids = ids(second);
  ASSERT_EQ(second_ids.size(), 1u) << second.output;
  EXPECT_NE(*first_ids.begin(), *second_ids.begin());
}

TEST(DdprunTest, RestartsRunOut) {
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=2"},
                                  {"--fail_before_restart=9"}));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_EQ(CountLines(run.output, "rank 1 fails on attempt"), 3) << run.output;
  EXPECT_THAT(run.output, HasSubstr("(restart 2 of 2)"));
}

// --max_run_time running out stops the job for good: a limit, not a
// failure that a restart could mend (it restarted, each time for as long).
TEST(DdprunTest, MaxRunTimeEndsTheJobWithoutRestart) {
  const std::string dir = testing::MakeTempDir("ddprun_max_run_time");
  const auto start = std::chrono::steady_clock::now();
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=2", "--max_run_time=2"},
                                  {"--sleep_ms=30000", "--pid_dir=" + dir}));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("restarting the job"))) << run.output;
  // Named by its flag, not only as "the deadline".
  EXPECT_THAT(run.output, HasSubstr("ddprun: --max_run_time (2000 ms) ran out: the workers were still running after "))
      << run.output;
  EXPECT_LT(seconds, 20) << run.output;
}

// The workers end of the forwarded signal itself: the grace period (60 s)
// outlasts the wait, so a worker the signal missed would hold the launcher
// there until its SIGKILL, and the launcher would not be done in time.
TEST(DdprunTest, SigtermAndSigintReachEveryWorker) {
  for (int signo : {SIGTERM, SIGINT}) {
    const std::string dir = testing::MakeTempDir("ddprun_forward_" + std::to_string(signo));
    auto group = testing::StartProgram(Cmd({"--standalone", "--nproc_per_node=3", "--grace_period=60"},
                                           {"--sleep_ms=30000", "--pid_dir=" + dir}));
    ASSERT_TRUE(group.ok()) << group.status();
    const std::vector<pid_t> workers = WorkerPids(dir, 3);
    const auto start = std::chrono::steady_clock::now();
    kill((*group)->pids()[0], signo);
    const auto run = testing::WaitProgram(**group, 20s);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << run.output;
    EXPECT_THAT(run.output, Not(HasSubstr("SIGKILL"))) << run.output;
    EXPECT_EQ(run.exit_code, 128 + signo) << run.output;
    EXPECT_THAT(run.output, HasSubstr("interrupted by " + std::string(signo == SIGTERM ? "SIGTERM" : "SIGINT") +
                                      "; forwarded it to every worker"));
    ExpectAllGone(workers);
  }
}

// After passing it on and stopping the workers, an interrupted launcher
// dies of the signal itself (default action) rather than exiting 128 + it,
// so that a shell loop over ddprun stops at Ctrl-C.
TEST(DdprunTest, InterruptedLauncherDiesOfTheSignal) {
  for (int signo : {SIGINT, SIGTERM, SIGHUP}) {
    const std::string dir = testing::MakeTempDir("ddprun_dies_of_" + std::to_string(signo));
    auto group = testing::StartProgram(
        Cmd({"--standalone", "--nproc_per_node=2"}, {"--sleep_ms=30000", "--pid_dir=" + dir}));
    ASSERT_TRUE(group.ok()) << group.status();
    const std::vector<pid_t> workers = WorkerPids(dir, 2);
    kill((*group)->pids()[0], signo);
    const auto run = testing::WaitProgram(**group, 20s);
    const WorkerExit& launcher = run.group.workers.at(0);
    EXPECT_TRUE(launcher.signaled) << SignalName(signo) << ": " << launcher.Describe() << "\n" << run.output;
    EXPECT_EQ(launcher.code, signo) << run.output;
    EXPECT_THAT(run.output, HasSubstr("interrupted by " + SignalName(signo)));
    ExpectAllGone(workers);
  }
  // A shell loop over two launches ends with the first.
  // bash, as a user's: it goes on after a child that exited 130 and stops
  // after one that died of SIGINT.
  const std::string dir = testing::MakeTempDir("ddprun_loop");
  ASSERT_EQ(mkdir((dir + "/0").c_str(), 0755), 0);
  ASSERT_EQ(mkdir((dir + "/1").c_str(), 0755), 0);
  auto group = testing::StartProgram(
      {"/bin/bash", "-c",
       "for c in 0 1; do \"$0\" --standalone --nproc_per_node=1 \"$1\" --sleep_ms=30000 --pid_dir=\"$2/$c\"; "
       "done; exit 0",
       Ddprun(), Worker(), dir});
  ASSERT_TRUE(group.ok()) << group.status();
  const pid_t first = testing::ReadPidFile(dir + "/0/rank0.restart0.pid", 10s);
  ASSERT_GT(first, 0);
  // The shell's child, the launcher, as Ctrl-C reaches the foreground group.
  pid_t launcher = testing::ParentPid(first);
  ASSERT_GT(launcher, 0);
  kill(launcher, SIGINT);
  kill((*group)->pids()[0], SIGINT);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(testing::ReadPidFile(dir + "/1/rank0.restart0.pid", 100ms), -1) << "the loop went on\n" << run.output;
  EXPECT_TRUE(testing::GoneWithin(first, 5s));
}

// Slurm's --signal=USR1@T, a checkpoint hook: SIGUSR1 and SIGUSR2 to the
// launcher reach every worker's process group and leave the launcher
// running; workers that checkpoint and exit 0 end the job with 0.
TEST(DdprunTest, SigusrReachesTheWorkersWithoutStoppingTheLauncher) {
  for (int signo : {SIGUSR1, SIGUSR2}) {
    const std::string name = signo == SIGUSR1 ? "USR1" : "USR2";
    const std::string dir = testing::MakeTempDir("ddprun_forward_" + name);
    auto group = testing::StartProgram(
        {Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c",
         "trap 'echo saved > \"$0/rank$RANK.saved\"; exit 0' " + name +
             "; echo $$ > \"$0/rank$RANK.pid\"; while :; do sleep 0.05; done",
         dir});
    ASSERT_TRUE(group.ok()) << group.status();
    const pid_t rank0 = testing::ReadPidFile(dir + "/rank0.pid", 10s);
    const pid_t rank1 = testing::ReadPidFile(dir + "/rank1.pid", 10s);
    ASSERT_GT(rank0, 0);
    ASSERT_GT(rank1, 0);
    kill((*group)->pids()[0], signo);
    const auto run = testing::WaitProgram(**group, 20s);
    EXPECT_FALSE(run.group.workers.at(0).signaled) << run.group.workers.at(0).Describe() << "\n" << run.output;
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(ReadFile(dir + "/rank0.saved"), "saved\n") << run.output;
    EXPECT_EQ(ReadFile(dir + "/rank1.saved"), "saved\n") << run.output;
    EXPECT_THAT(run.output, HasSubstr("passed " + SignalName(signo) + " on to the workers")) << run.output;
  }
}

// A Python script given as the program (torchrun's habit) gets a hint.
TEST(DdprunTest, PythonScriptAsProgramGetsAHint) {
  auto run = RunProgram({Ddprun(), "--standalone", "no_such_train.py", "--lr=1"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("program 'no_such_train.py' not found in PATH; for a Python script give "
                                    "the interpreter: ddprun ... python3 no_such_train.py"));
  // A script in the current folder, without a .py, and another program
  // there: each named as it was given.
  const std::string dir = testing::MakeTempDir("ddprun_python_hint");
  std::ofstream(dir + "/train") << "import sys\n";
  run = RunProgram({"/bin/sh", "-c", "cd \"$1\" && PATH=/usr/bin:/bin exec \"$0\" train", Ddprun(), dir});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("program 'train' not found in PATH; 'train' in the current folder is "
                                    "not executable; for a Python script give the interpreter: ddprun ... "
                                    "python3 train"));
  chmod((dir + "/train").c_str(), 0755);
  run = RunProgram({"/bin/sh", "-c", "cd \"$1\" && PATH=/usr/bin:/bin exec \"$0\" train", Ddprun(), dir});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("program 'train' not found in PATH; for the one in the current folder "
                                    "give its path: ./train"));
}

// SIGTERM while the launcher stops the workers after a failure (here: for
// the grace period, as rank 0 ignores SIGTERM) ends the launcher with 128 +
// the signal; no restart, though restarts are left.
TEST(DdprunTest, SigtermWhileStoppingAfterAFailureEndsTheJobWithoutRestart) {
  const std::string dir = testing::MakeTempDir("ddprun_term_while_stopping");
  // Rank 1 fails after the rendezvous, when both ranks run (rank 0 ignores
  // SIGTERM by then). The grace period outlasts a loaded machine's delay
  // between the launcher's SIGTERM to rank 0 and the test's to the launcher;
  // the test takes that long, as the launcher waits it out for rank 0.
  auto group = testing::StartProgram(
      Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=3", "--grace_period=10"},
          {"--ignore_sigterm", "--store", "--exit_code=1:5", "--sleep_ms=30000", "--pid_dir=" + dir}));
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  ASSERT_GT(workers[1], 0);
  ASSERT_TRUE(testing::GoneWithin(workers[1], 20s));  // rank 1 failed
  // Rank 0 got the launcher's SIGTERM: the launcher is in its grace period.
  ASSERT_EQ(testing::ReadPidFile(dir + "/rank0.restart0.got_term", 20s), workers[0]);
  ASSERT_FALSE(testing::ProcessGone(workers[0]));
  kill((*group)->pids()[0], SIGTERM);
  const auto run = testing::WaitProgram(**group, 30s);
  EXPECT_EQ(run.exit_code, 128 + SIGTERM) << run.output;
  EXPECT_THAT(run.output, HasSubstr("then interrupted by SIGTERM"));
  EXPECT_THAT(run.output, Not(HasSubstr("restarting")));
  EXPECT_EQ(CountLines(run.output, "exited with code 5"), 1) << run.output;
  EXPECT_EQ(testing::ReadPidFile(dir + "/rank0.restart1.pid", 100ms), -1) << "the job restarted";
  ExpectAllGone(workers);
}

// A single-node launcher interrupted between two attempts, where no group
// forwards the signal, reports it and starts no restart; it used to die of
// the signal there without a word. Its stderr is a full pipe, which holds
// it in that gap: its line about the restart waits there (up to 2 s, see
// WriteLauncherLine). The group is gone once its watcher (a child named
// ddp-watcher) is.
TEST(DdprunTest, InterruptBetweenAttemptsIsReportedAndStartsNoRestart) {
  const std::string dir = testing::MakeTempDir("ddprun_interrupt_between");
  auto launcher = testing::HeldLauncher::Start(Cmd({"--standalone", "--nproc_per_node=2", "--max_restarts=2"},
                                                   {"--sleep_ms=30000", "--pid_dir=" + dir}),
                                               dir + "/stdout");
  ASSERT_TRUE(launcher.ok()) << launcher.status();
  const pid_t pid = (*launcher)->pid();
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  ASSERT_GT(workers[0], 0);
  ASSERT_GT(workers[1], 0);
  ASSERT_TRUE(testing::Within(10s, [&] { return testing::HasChildNamed(pid, "ddp-watcher"); }));
  kill(workers[1], SIGKILL);
  ASSERT_TRUE(testing::Within(20s, [&] { return !testing::HasChildNamed(pid, "ddp-watcher"); }));
  // The group's end is not yet the gap: the launcher still looks for a
  // signal caught meanwhile before its line about the restart, which it
  // then writes into the full pipe, where it is held.
  const Status held = (*launcher)->AwaitHeldAtStderr(10s);
  ASSERT_TRUE(held.ok()) << held;
  kill(pid, SIGTERM);

  const std::string output = (*launcher)->ReadStderr(20s);
  const int status = (*launcher)->Reap(20s);
  ASSERT_NE(status, -1) << "the launcher did not end\n" << output;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status << "\n" << output;
  EXPECT_THAT(output, HasSubstr("restarting the job (restart 1 of 2)\n"));
  EXPECT_THAT(output, HasSubstr("ddprun: interrupted by SIGTERM before restart 1 started\n"));
  EXPECT_EQ(testing::ReadPidFile(dir + "/rank0.restart1.pid", 100ms), -1) << "the job restarted\n" << output;
  EXPECT_EQ(testing::ReadPidFile(dir + "/rank1.restart1.pid", 100ms), -1) << "the job restarted\n" << output;
  ExpectAllGone(workers);
}

// `nohup ddprun ...`: SIGHUP stays ignored by the launcher and its workers,
// which run to their end.
TEST(DdprunTest, NohupKeepsSighupIgnored) {
  const std::string dir = testing::MakeTempDir("ddprun_nohup");
  std::vector<std::string> argv = {"/bin/sh", "-c", "trap '' HUP; exec \"$@\"", "sh"};
  for (const std::string& a : Cmd({"--standalone", "--nproc_per_node=2"},
                                  {"--sleep_ms=1500", "--pid_dir=" + dir})) {
    argv.push_back(a);
  }
  auto group = testing::StartProgram(argv);
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> workers = WorkerPids(dir, 2);
  ASSERT_GT(workers[0], 0);
  kill((*group)->pids()[0], SIGHUP);  // sh exec'd ddprun: same pid
  kill(workers[0], SIGHUP);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 done"));
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 done"));
  EXPECT_THAT(run.output, Not(HasSubstr("interrupted")));
}

// Runs a 2-worker ddprun job whose workers run `script`, with the
// launcher's `stream` (">" stdout, "2>" stderr) a pipe held open that
// nobody reads; the other stream is captured. Expects it over within 20 s.
testing::ProgramRun RunWithAnUnreadPipe(const std::string& stream, const std::string& script) {
  const std::string fifo =
      testing::MakeTempDir(stream == ">" ? "ddprun_unread_stdout" : "ddprun_unread_stderr") + "/pipe";
  EXPECT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // held, never read
  EXPECT_GE(reader, 0);
  const auto start = Clock::now();
  auto run = RunProgram({"/bin/sh", "-c", "exec \"$@\" " + stream + " \"$0\"", fifo, Ddprun(),
                         "--standalone", "--nproc_per_node=2", "/bin/sh", "-c", script},
                        {}, 30s);
  close(reader);
  EXPECT_LT(Clock::now() - start, 20s);
  return run;
}

// The launcher's stdout is a pipe that nobody reads: it must not hang in a
// write. It gives up on the output after 2 s without progress, keeps
// watching the workers (which finish) and says how much it dropped.
TEST(DdprunTest, StdoutThatNobodyReadsDoesNotHangTheLauncher) {
  const auto run = RunWithAnUnreadPipe(">", "yes 0123456789abcdef | head -c 2000000; echo finished >&2");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] finished\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] finished\n"));
  EXPECT_THAT(run.output, ContainsRegex("ddprun: dropped [0-9]+ bytes of worker output: this launcher's "
                                        "stdout or stderr took nothing for 2 s\n"));
}

// Output dropped off an unread stdout while a log file stopped too (here
// at the file size limit, EFBIG): the end line must not say the log files
// hold every stream whole, as it did; it points at the stopped ones,
// named on the lines after it.
TEST(DdprunTest, DroppedOutputDoesNotCallTheLogsWholeWhenOneStopped) {
  const std::string dir = testing::MakeTempDir("ddprun_unread_stdout_full_log");
  const std::string fifo = dir + "/pipe";
  EXPECT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // held, never read
  ASSERT_GE(reader, 0);
  // SIGXFSZ ignored: a write past the limit fails with EFBIG instead of
  // ending the launcher.
  auto run = RunProgram({"/bin/sh", "-c", "trap '' XFSZ; ulimit -f 64; exec \"$@\" > \"$0\"", fifo, Ddprun(),
                         "--standalone", "--nproc_per_node=1", "--log_dir=" + dir + "/logs", "--tee=3",
                         "/bin/sh", "-c", "yes 0123456789abcdef | head -c 2000000; echo finished >&2"},
                        {}, 30s);
  close(reader);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("ddprun: rank 0's log file '[^']*stdout.log' stopped after [0-9]+ bytes"));
  EXPECT_THAT(run.output, ContainsRegex("ddprun: dropped [0-9]+ bytes of worker output: this launcher's "
                                        "stdout or stderr took nothing for 2 s \\(the streams written to log "
                                        "files are whole there, but for the log files that stopped, named "
                                        "below\\)\n"));
}

// The workers fill the launcher's stderr and fail; the launcher's own
// report of the failure goes there too and must give up on it, not wait
// forever.
TEST(DdprunTest, StderrThatNobodyReadsDoesNotHangTheFailureReport) {
  const auto run = RunWithAnUnreadPipe("2>", "yes 0123456789abcdef | head -c 2000000 >&2; exit 3");
  EXPECT_EQ(run.exit_code, 1) << run.output;
}

TEST(DdprunTest, LauncherKilledBySigkillTakesItsWorkers) {
  const std::string dir = testing::MakeTempDir("ddprun_sigkill");
  auto group = testing::StartProgram(
      Cmd({"--standalone", "--nproc_per_node=3"}, {"--sleep_ms=30000", "--pid_dir=" + dir}));
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<pid_t> workers = WorkerPids(dir, 3);
  kill((*group)->pids()[0], SIGKILL);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  ExpectAllGone(workers);
}

// Starts `ddprun` (a ddprun binary) with `nproc` shell workers that each
// start a child of their own (which has no death signal), sends SIGKILL to
// `target(launcher)`, and expects the workers and their children gone: the
// group's watcher kills the children. Any that survive (a failure) are
// killed at the end, by their own pids.
void ExpectSigkillTakesTheWorkersChildren(const std::string& name, const std::string& ddprun, int nproc,
                                         pid_t (*target)(const WorkerGroup&)) {
  const std::string dir = testing::MakeTempDir(name);
  auto group = testing::StartProgram(
      {ddprun, "--standalone", "--nproc_per_node=" + std::to_string(nproc), "/bin/sh", "-c",
       "cd '" + dir + "'; echo $$ > w$RANK.tmp; mv w$RANK.tmp w$RANK.pid; " +
           "sleep 60 & echo $! > c$RANK.tmp; mv c$RANK.tmp c$RANK.pid; wait"});
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    pids.push_back(testing::ReadPidFile(dir + "/w" + std::to_string(r) + ".pid", 10s));
    pids.push_back(testing::ReadPidFile(dir + "/c" + std::to_string(r) + ".pid", 10s));
  }
  kill(target(**group), SIGKILL);
  const auto run = testing::WaitProgram(**group, 20s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  ExpectAllGone(pids);
  for (pid_t pid : pids) {
    if (pid > 0 && !testing::ProcessGone(pid)) kill(pid, SIGKILL);
  }
}

pid_t TheLauncher(const WorkerGroup& g) { return g.pids()[0]; }

TEST(DdprunTest, LauncherKilledBySigkillTakesTheWorkersChildrenToo) {
  ExpectSigkillTakesTheWorkersChildren("ddprun_sigkill_children", Ddprun(), 2, TheLauncher);
}

TEST(DdprunTest, SigkillToTheLaunchersWholeProcessGroupTakesTheWorkersChildrenToo) {
  // `kill -9 -PGID` of the launcher's group (what a supervisor may do): the
  // watcher is in a group of its own, so it outlives the launcher and does
  // its work. (Within the launcher's group it died at the same time, and
  // the children were left running; a group-wide kill of the launcher's
  // group by the test's own harness raced it the same way.)
  ExpectSigkillTakesTheWorkersChildren("ddprun_sigkill_group", Ddprun(), 2,
                                       [](const WorkerGroup& g) { return -g.process_group(); });
}

// Without a terminal (output to a pipe, as in batch jobs) the first worker
// leads the workers' group, and ddprun may be killed right after starting
// it: here ddprun_pausing waits 10 s there, and is killed once the worker's
// child runs. The watcher used to start only after the first worker, so
// none was there, and the child outlived everything.
TEST(DdprunTest, SigkillRightAfterTheFirstWorkerStartedTakesItsChildrenToo) {
  ExpectSigkillTakesTheWorkersChildren("ddprun_sigkill_pausing",
                                       testing::Runfile("transport/launch/ddprun_pausing"), 1, TheLauncher);
}

TEST(DdprunTest, PerRankLogFilesAndTee) {
  const std::string dir = testing::MakeTempDir("ddprun_logs");
  auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--log_dir=" + dir, "--redirects=3"},
                            {"--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("rank 0 done")));  // files only
  const std::string run_dir = RunDir(dir);
  // Named after the run id --standalone makes up (DDP_RUN_ID).
  EXPECT_THAT(run_dir, ContainsRegex("/[0-9a-f]{16}_[A-Za-z0-9]{6}$"));
  EXPECT_THAT(run.output, HasSubstr("ddprun: this run's logs: " + run_dir +
                                    "/attempt_K/LOCAL_RANK/stdout.log, stderr.log and error.json" + kIfWritten));
  for (int r = 0; r < 2; ++r) {
    const std::string log = ReadFile(run_dir + "/attempt_0/" + std::to_string(r) + "/stdout.log");
    EXPECT_THAT(log, HasSubstr("rank " + std::to_string(r) + "/2 local"));
    EXPECT_THAT(log, HasSubstr("rank " + std::to_string(r) + " done\n"));
  }
  const std::string tee_dir = testing::MakeTempDir("ddprun_tee");
  run = RunProgram(Cmd({"--master_port=0", "--nproc_per_node=2", "--log_dir=" + tee_dir, "--tee"},
                       {"--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 done"));
  // Without --rdzv_id (torchrun's default "none").
  EXPECT_THAT(RunDir(tee_dir), ContainsRegex("/none_[A-Za-z0-9]{6}$"));
  EXPECT_THAT(ReadFile(RunDir(tee_dir) + "/attempt_0/1/stdout.log"), HasSubstr("rank 1 done\n"));
}

// As torchrun's, --log_dir alone keeps the workers' output on the terminal
// and writes no log files (they take -r 3 or -t 3); the run's folder holds
// the error files (AFailedWorkersErrorFileIsReportedAndKeptWithTheLogs).
// The output went to the files only, and the terminal showed nothing.
TEST(DdprunTest, LogDirAloneKeepsTheTerminalAsTorchrun) {
  const std::string dir = testing::MakeTempDir("ddprun_log_dir_alone");
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--log_dir=" + dir}, {"--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[0] rank 0 done\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 done\n"));
  const std::string run_dir = RunDir(dir);
  EXPECT_THAT(run.output,
              HasSubstr("ddprun: this run's error files: " + run_dir + "/attempt_K/LOCAL_RANK/error.json" +
                        kIfWritten));
  for (const char* log : {"/attempt_0/0/stdout.log", "/attempt_0/1/stderr.log"}) {
    EXPECT_NE(access((run_dir + log).c_str(), F_OK), 0) << run_dir + log;
  }
}

// As torchrun's <log_dir>/<run_id>_<random>/: a second run with the same
// --log_dir writes a folder of its own and leaves the first run's logs and
// error files as they were. The folder is named after --rdzv_id; with
// --standalone, after the run id it makes up, as torchrun's.
TEST(DdprunTest, EachRunKeepsItsLogsInAFolderOfItsOwn) {
  const std::string script =
      "echo \"run $0 rank $RANK\"; echo \"id $TORCHELASTIC_RUN_ID\"; if [ \"$RANK\" = 1 ]; then "
      "echo \"$0\" > \"$TORCHELASTIC_ERROR_FILE\"; exit 3; fi";
  for (const bool standalone : {false, true}) {
    SCOPED_TRACE(standalone ? "--standalone" : "--rdzv_id=job7");
    const std::string dir = testing::MakeTempDir(standalone ? "ddprun_two_standalone_runs" : "ddprun_two_runs");
    auto launch = [&](const std::string& which) {
      return RunProgram({Ddprun(), standalone ? "--standalone" : "--master_port=0", "--nproc_per_node=2",
                         "--rdzv_id=job7", "--log_dir=" + dir, "--redirects=3", "/bin/sh", "-c", script,
                         which});
    };
    auto run = launch("first");
    EXPECT_NE(run.exit_code, 0) << run.output;
    run = launch("second");
    EXPECT_NE(run.exit_code, 0) << run.output;
    const std::vector<std::string> runs = RunDirs(dir);
    ASSERT_EQ(runs.size(), 2u) << run.output;
    std::vector<std::string> seen;
    std::set<std::string> ids;
    for (const std::string& run_dir : runs) {
      const std::string log = ReadFile(run_dir + "/attempt_0/1/stdout.log");
      const size_t at = log.find("\nid ");
      ASSERT_NE(at, std::string::npos) << log;
      const std::string id = log.substr(at + 4, log.find('\n', at + 1) - at - 4);
      ids.insert(id);
      // Named after the run id the workers got (TORCHELASTIC_RUN_ID).
      EXPECT_THAT(run_dir, ContainsRegex("/" + id + "_[A-Za-z0-9]{6}$"));
      seen.push_back(log.substr(0, at + 1));
      EXPECT_EQ(ReadFile(run_dir + "/attempt_0/1/error.json"),
                log.find("first") != std::string::npos ? "first\n" : "second\n");
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, (std::vector<std::string>{"run first rank 1\n", "run second rank 1\n"}));
    if (standalone) {
      // A run id of its own for each run, not --rdzv_id.
      EXPECT_EQ(ids.size(), 2u);
      EXPECT_EQ(ids.count("job7"), 0u);
    } else {
      EXPECT_EQ(ids, std::set<std::string>{"job7"});
    }
  }
}

// torchrun's TORCHELASTIC_ERROR_FILE: what a failed worker wrote there (here
// in the layout of torch.distributed.elastic's @record) is in ddprun's
// report, and each attempt's file stays beside its logs.
TEST(DdprunTest, AFailedWorkersErrorFileIsReportedAndKeptWithTheLogs) {
  const std::string dir = testing::MakeTempDir("ddprun_error_file");
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then printf '{\"message\": {\"message\": \"ValueError: shard %s missing\", "
      "\"extraInfo\": {\"timestamp\": \"1700000000\"}}}' \"$TORCHELASTIC_RESTART_COUNT\" "
      "> \"$TORCHELASTIC_ERROR_FILE\"; exit 3; fi; sleep 30";
  const auto run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "--max_restarts=1",
                               "--log_dir=" + dir, "/bin/sh", "-c", script});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  for (const char* attempt : {"0", "1"}) {
    EXPECT_THAT(run.output, ContainsRegex(std::string("rank 1 \\(pid [0-9]+\\) exited with code 3; stopping the "
                                                      "other workers; rank 1 reported: ValueError: shard ") +
                                          attempt + " missing"));
    EXPECT_THAT(ReadFile(RunDir(dir) + "/attempt_" + attempt + "/1/error.json"),
                HasSubstr(std::string("shard ") + attempt + " missing"));
  }
}

// torchrun's @record on its own main: ddprun's own TORCHELASTIC_ERROR_FILE
// (from whoever started it) gets the root-cause worker's error, or, when no
// worker wrote one, the launcher's reason.
TEST(DdprunTest, TheLaunchersOwnErrorFileGetsTheRootCause) {
  const std::string dir = testing::MakeTempDir("ddprun_own_error_file");
  const std::string own = dir + "/launcher.error.json";
  const std::string script =
      "if [ \"$RANK\" = 1 ]; then printf '{\"message\": {\"message\": \"ValueError: shard missing\", "
      "\"extraInfo\": {\"py_callstack\": \"Traceback: train.py line 7\", \"timestamp\": \"1700000000\"}}}' "
      "> \"$TORCHELASTIC_ERROR_FILE\"; exit 3; fi; sleep 30";
  auto run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "/bin/sh", "-c", script},
                        {{"TORCHELASTIC_ERROR_FILE", own}});
  EXPECT_NE(run.exit_code, 0) << run.output;
  // As torchrun's: the worker's whole record (its traceback too), with the
  // worker's exit code.
  EXPECT_EQ(ReadFile(own),
            "{\"message\":{\"errorCode\":3,\"extraInfo\":{\"py_callstack\":\"Traceback: train.py line 7\","
            "\"timestamp\":\"1700000000\"},\"message\":\"ValueError: shard missing\"}}\n")
      << run.output;

  // No worker wrote one: the launcher's own line.
  unlink(own.c_str());
  run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2"}, {"--store", "--exit_code=1:4"}),
                   {{"TORCHELASTIC_ERROR_FILE", own}});
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_THAT(ReadFile(own), ContainsRegex("ddprun: rank 1 \\(pid [0-9]+\\) exited with code 4")) << run.output;

  // Bad input, before anything starts.
  unlink(own.c_str());
  run = RunProgram({Ddprun(), "--nproc_per_node=0", "x"}, {{"TORCHELASTIC_ERROR_FILE", own}});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(ReadFile(own), HasSubstr("ddprun: --nproc_per_node")) << run.output;

  // Success: nothing written.
  unlink(own.c_str());
  run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2"}, {}), {{"TORCHELASTIC_ERROR_FILE", own}});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(access(own.c_str(), F_OK), 0);
}

// A restart that fails before its workers run reports its own cause, not
// the worker error of the attempt before it (which was kept, and written).
// Attempt 0's failing worker puts a file where attempt 1's log folder goes,
// so that attempt 1's spawn fails.
TEST(DdprunTest, TheLaunchersOwnErrorFileGetsTheLastAttemptsCause) {
  const std::string dir = testing::MakeTempDir("ddprun_own_error_file_restart");
  const std::string logs = dir + "/logs";
  const std::string own = dir + "/launcher.error.json";
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then "
      "for d in " + logs + "/*/; do : > \"${d}attempt_1\"; done; "
      "printf '{\"message\": {\"message\": \"ValueError: shard missing\", "
      "\"extraInfo\": {\"timestamp\": \"1700000000\"}}}' > \"$TORCHELASTIC_ERROR_FILE\"; exit 3; fi; "
      "sleep 30";
  const auto run = RunProgram({Ddprun(), "--standalone", "--nproc_per_node=2", "--max_restarts=1",
                               "--log_dir=" + logs, "--redirects=3", "/bin/sh", "-c", script},
                              {{"TORCHELASTIC_ERROR_FILE", own}});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  ASSERT_THAT(run.output, HasSubstr("restarting the job (restart 1 of 1)"));
  const std::string written = ReadFile(own);
  EXPECT_THAT(written, Not(HasSubstr("shard missing"))) << written << run.output;
  EXPECT_THAT(written, HasSubstr("ddprun: the restart (attempt 1) could not start the workers: cannot create log "
                                 "directory"))
      << written << run.output;
}

// torchrun's --local_ranks_filter: the terminal shows the chosen ranks,
// the log files (with --tee) still get every rank's output.
TEST(DdprunTest, LocalRanksFilterChoosesWhoseOutputReachesTheTerminal) {
  const std::string dir = testing::MakeTempDir("ddprun_filter");
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=3", "--local_ranks_filter=1",
                                   "--log_dir=" + dir, "--tee"},
                                  {"--print_env"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[1] rank 1 done"));
  EXPECT_THAT(run.output, Not(HasSubstr("[0] ")));
  EXPECT_THAT(run.output, Not(HasSubstr("[2] ")));
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(ReadFile(RunDir(dir) + "/attempt_0/" + std::to_string(r) + "/stdout.log"),
                HasSubstr("rank " + std::to_string(r) + " done\n"));
  }
}

TEST(DdprunTest, NoPrefix) {
  const auto run = RunProgram(Cmd({"--standalone", "--nproc_per_node=2", "--no_prefix"}, {}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 1 done"));
  EXPECT_THAT(run.output, Not(HasSubstr("[1]")));
}

// torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE ($rank, $local_rank and
// $role_name, braced or not; $$ is $) is the prefix of the workers' lines
// instead of "[rank] ". It was ignored.
TEST(DdprunTest, TorchrunsLinePrefixTemplateStartsTheWorkersLines) {
  const std::vector<std::string> argv = {Ddprun(), "--standalone", "--nproc_per_node=2", "--role=trainer",
                                         "/bin/sh", "-c", "echo \"hello from $RANK\""};
  auto run = RunProgram(argv, {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${role_name}$rank/${local_rank} $$$ranks: "}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("trainer0/0 $$ranks: hello from 0\n"));
  EXPECT_THAT(run.output, HasSubstr("trainer1/1 $$ranks: hello from 1\n"));
  EXPECT_THAT(run.output, Not(HasSubstr("[1] ")));
  // --no_prefix still turns it off.
  std::vector<std::string> plain = argv;
  plain.insert(plain.begin() + 1, "--no_prefix");
  run = RunProgram(plain, {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[$rank]: "}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(CountLines(run.output, "hello from"), 2) << run.output;
  EXPECT_THAT(run.output, Not(HasSubstr("]: hello")));
}

// Bad input: exit status 2 and exactly one line, before any worker starts.
void ExpectBadInput(std::vector<std::string> argv, const std::string& message,
                    std::vector<std::pair<std::string, std::string>> env = {}) {
  const auto run = RunProgram(std::move(argv), std::move(env));
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_EQ(run.output, "ddprun: " + message + "\n");
}

TEST(DdprunTest, BadInputGetsOneLineBeforeAnythingStarts) {
  ExpectBadInput({Ddprun(), "--nproc_per_node=0", Worker()}, "--nproc_per_node=0 must be in [1, 4096]");
  ExpectBadInput({Ddprun(), "--nnodes=2", "--node_rank=2", "--master_addr=127.0.0.1", Worker()},
                 "--node_rank=2 is not below --nnodes=2");
  ExpectBadInput({Ddprun(), "--nnodes=2", Worker()},
                 "--master_addr (or --rdzv_endpoint) is required with --nnodes=2 (the address of "
                 "node 0, where the store listens)");
  ExpectBadInput({Ddprun(), "--standalone", "no-such-program-xyz"},
                 "program 'no-such-program-xyz' not found in PATH");
  ExpectBadInput({Ddprun(), "--standalone", "/nonexistent/worker"},
                 "program '/nonexistent/worker': No such file or directory");
  // A script whose #! interpreter is missing: exec says ENOENT of a file
  // that is there; the line names the interpreter.
  const std::string dir = testing::MakeTempDir("ddprun_shebang");
  const std::string script = dir + "/train.sh";
  std::ofstream(script) << "#!/nonexistent/python3 -u\nprint(1)\n";
  ASSERT_EQ(chmod(script.c_str(), 0755), 0);
  ExpectBadInput({Ddprun(), "--standalone", script},
                 "cannot start rank 0: exec '" + script +
                     "': No such file or directory (the interpreter '/nonexistent/python3' named on its #! line "
                     "does not exist)");
  const std::string plain = testing::MakeTempDir("ddprun_bad") + "/not_executable";
  std::ofstream(plain) << "#!/bin/sh\n";
  chmod(plain.c_str(), 0644);
  ExpectBadInput({Ddprun(), "--standalone", plain}, "program '" + plain + "' is not executable");
  ExpectBadInput({Ddprun(), "--standalone"}, "no program given: ddprun [flags] [--] PROGRAM [ARGS...]");
}

// Workers that cannot start for lack of resources (here descriptors: a
// `ulimit -n` too low for 64 workers' pipes) are no bad input: exit 1 with
// a line that says so, not the exit 2 of a wrong flag or program.
TEST(DdprunTest, AStartThatRunsOutOfDescriptorsIsNoBadInput) {
  const auto run = RunProgram({"/bin/sh", "-c", "ulimit -n 48 && exec \"$0\" \"$@\"", Ddprun(), "--standalone",
                               "--nproc_per_node=64", Worker()});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, ContainsRegex("ddprun: the workers could not start for lack of resources "
                                        "\\(not bad input\\): cannot start rank [0-9]+: cannot make a pipe "
                                        "[^\n]*Too many open files[^\n]*raise the limit or start fewer "
                                        "workers\n"))
      << run.output;
}

// torchrun's stream codes for one stream (1 stdout, 2 stderr) and its
// per-rank maps (`-r 0:1,1:2`, also as the next argument) route each
// worker's each stream as torchrun's logs specs do: redirected, to its
// file only; teed, to its file and the terminal; neither, to the terminal
// with no file. They were refused ("1, 2 and per-rank maps are not
// supported").
TEST(DdprunTest, TorchrunsOneStreamCodesAndPerRankMapsRouteEachStream) {
  const std::vector<std::string> program = {"/bin/sh", "-c", "echo out$LOCAL_RANK; echo err$LOCAL_RANK >&2"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), Ddprun());
    flags.insert(flags.end(), program.begin(), program.end());
    return flags;
  };
  auto exists = [](const std::string& path) { return access(path.c_str(), F_OK) == 0; };
  // Local rank 0's stdout and local rank 1's stderr to their files only;
  // local rank 2's stderr teed; local rank 3's neither.
  const std::string dir = testing::MakeTempDir("ddprun_stream_map");
  auto run = RunProgram(with({"--standalone", "--nproc_per_node=4", "--log_dir=" + dir, "-r", "0:1,1:2", "-t", "2:2"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::string attempt = RunDir(dir) + "/attempt_0/";
  EXPECT_EQ(ReadFile(attempt + "0/stdout.log"), "out0\n");
  EXPECT_FALSE(exists(attempt + "0/stderr.log"));
  EXPECT_EQ(ReadFile(attempt + "1/stderr.log"), "err1\n");
  EXPECT_FALSE(exists(attempt + "1/stdout.log"));
  EXPECT_EQ(ReadFile(attempt + "2/stderr.log"), "err2\n");
  EXPECT_FALSE(exists(attempt + "2/stdout.log"));
  EXPECT_THAT(run.output, Not(HasSubstr("out0")));
  EXPECT_THAT(run.output, HasSubstr("[0] err0\n"));
  EXPECT_THAT(run.output, HasSubstr("[1] out1\n"));
  EXPECT_THAT(run.output, Not(HasSubstr("err1")));
  EXPECT_THAT(run.output, HasSubstr("[2] out2\n"));
  EXPECT_THAT(run.output, HasSubstr("[2] err2\n"));
  // The line naming the logs names each rank's files: it said
  // "stdout.log, stderr.log and error.json" for every local rank.
  EXPECT_THAT(run.output, HasSubstr("ddprun: this run's logs: " + RunDir(dir) +
                                    "/attempt_K/LOCAL_RANK/ holds stdout.log and error.json for local rank 0; "
                                    "stderr.log and error.json for local ranks 1-2; error.json for local rank "
                                    "3" +
                                    kIfWritten));
  EXPECT_FALSE(exists(attempt + "3/stdout.log"));
  EXPECT_FALSE(exists(attempt + "3/stderr.log"));
  EXPECT_THAT(run.output, HasSubstr("[3] out3\n"));
  EXPECT_THAT(run.output, HasSubstr("[3] err3\n"));

  // One code for every worker: --tee 1 (the next argument) keeps both
  // streams on the terminal and logs stdout; -r2 takes stderr off it.
  const std::string dir2 = testing::MakeTempDir("ddprun_stream_code");
  run = RunProgram(with({"--standalone", "--nproc_per_node=2", "--log_dir=" + dir2, "--tee", "1", "-r2"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  attempt = RunDir(dir2) + "/attempt_0/";
  for (const std::string local : {"0", "1"}) {
    EXPECT_EQ(ReadFile(attempt + local + "/stdout.log"), "out" + local + "\n");
    EXPECT_EQ(ReadFile(attempt + local + "/stderr.log"), "err" + local + "\n");
    EXPECT_THAT(run.output, HasSubstr("[" + local + "] out" + local + "\n"));
    EXPECT_THAT(run.output, Not(HasSubstr("err" + local)));
  }

  // The line naming the logs names the files written: -r1 writes no
  // stderr.log (it said "stdout.log, stderr.log and error.json").
  const std::string dir3 = testing::MakeTempDir("ddprun_stream_one");
  run = RunProgram(with({"--standalone", "--nproc_per_node=1", "--log_dir=" + dir3, "-r1"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ddprun: this run's logs: " + RunDir(dir3) +
                                    "/attempt_K/LOCAL_RANK/stdout.log and error.json" + kIfWritten));

  // Bad values are still refused naming the flag, also as the next
  // argument (they were taken for the program), and a bare --tee is 3.
  const std::string codes =
      "' is not one of torchrun's stream codes 0 (none), 1 (stdout), 2 (stderr), 3 (both), nor "
      "LOCAL_RANK:CODE,... (e.g. 0:3,1:2)";
  ExpectBadInput({Ddprun(), "--standalone", "--tee", "0:3,1:4", "/bin/true"}, "--tee=0:3,1:4: '1:4" + codes);
  ExpectBadInput({Ddprun(), "--standalone", "--tee", "4", "/bin/true"}, "--tee=4: '4" + codes);
  run = RunProgram({Ddprun(), "--standalone", "--log_dir=" + testing::MakeTempDir("ddprun_tee_next"), "--tee",
                    "/bin/sh", "-c", "echo teed"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("teed\n"));
}

// As torchrun's, --rdzv_conf takes spaces around its keys and values
// ("join_timeout=900, read_timeout=5", as people write it); the second
// item was refused as an unknown key ' read_timeout'.
TEST(DdprunTest, RdzvConfTakesSpacesAroundItsItems) {
  const auto run = RunProgram({Ddprun(), "--standalone", "--rdzv-conf", "join_timeout=900, read_timeout = 5",
                               "/bin/sh", "-c", "echo conf ok"});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("conf ok\n"));
}

// torchrun's --duplicate_stdout_filters and --duplicate_stderr_filters copy
// matching lines to a file ddprun does not make: refused with the reason,
// and where the lines are instead. They were "unknown" flags.
TEST(DdprunTest, DuplicateOutputFiltersAreRefusedWithTheReason) {
  const std::string why =
      " is not supported: ddprun copies no matching lines to a file of their own (a worker's output goes to the "
      "terminal and, with --tee or --redirects, to its stdout.log and stderr.log, which grep can filter)";
  ExpectBadInput({Ddprun(), "--standalone", "--duplicate-stdout-filters", "loss,step", "/bin/true"},
                 "--duplicate_stdout_filters=loss,step" + why);
  ExpectBadInput({Ddprun(), "--standalone", "/bin/true"},
                 "PET_DUPLICATE_STDERR_FILTERS='nan' (from the environment): --duplicate_stderr_filters=nan" + why,
                 {{"PET_DUPLICATE_STDERR_FILTERS", "nan"}});
}

// torchrun's ways of running Python inside itself are refused with what to
// run instead: the interpreter with -m, or with the script. --run_path
// was told to use `python3 -m MODULE`, which is not what it runs.
TEST(DdprunTest, TorchrunsInProcessPythonFlagsAreRefusedWithWhatToRunInstead) {
  ExpectBadInput({Ddprun(), "--standalone", "-m", "mypkg.train"},
                 "-m runs a Python module under torchrun; ddprun starts programs: give the program (e.g. "
                 "python3 -m MODULE)");
  ExpectBadInput({Ddprun(), "--standalone", "--run-path", "/abs/train.py"},
                 "--run_path runs a Python script inside torchrun's own interpreter; ddprun starts programs: "
                 "give the interpreter and the script (e.g. python3 /abs/path/script.py)");
  ExpectBadInput({Ddprun(), "--standalone", "/bin/true"},
                 "PET_MODULE='1' (from the environment): --module is torchrun's way of running Python; ddprun "
                 "starts programs: give the program (e.g. python3 -m MODULE)",
                 {{"PET_MODULE", "1"}});
}

// `bazel run //:ddprun -- ... ./train` runs ddprun in its runfiles folder
// with the user's folder in BUILD_WORKING_DIRECTORY: a relative program,
// --log_dir and program argument are the user's, and the workers run there.
TEST(DdprunTest, UnderBazelRunRelativePathsAreTheUsersFolder) {
  const std::string user = testing::MakeTempDir("ddprun_user_folder");
  const std::string script = user + "/hello.sh";
  std::ofstream(script) << "#!/bin/sh\necho \"rank $RANK\" > \"$1.$RANK\"\necho hello $RANK\n";
  chmod(script.c_str(), 0755);
  // This test runs in its runfiles folder, where there is no hello.sh.
  ASSERT_NE(access("hello.sh", F_OK), 0);
  const auto run = RunProgram(
      {Ddprun(), "--standalone", "--nproc_per_node=2", "--log_dir=logs", "--tee", "./hello.sh", "ran"},
      {{"BUILD_WORKING_DIRECTORY", user}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < 2; ++r) {
    const std::string rs = std::to_string(r);
    EXPECT_EQ(ReadFile(user + "/ran." + rs), "rank " + rs + "\n");
    EXPECT_THAT(ReadFile(RunDir(user + "/logs") + "/attempt_0/" + rs + "/stdout.log"),
                HasSubstr("hello " + rs + "\n"));
  }
  ExpectBadInput({Ddprun(), "--standalone", "./hello.sh"},
                 "cannot enter BUILD_WORKING_DIRECTORY='" + user + "/missing': No such file or directory",
                 {{"BUILD_WORKING_DIRECTORY", user + "/missing"}});
}

TEST(DdprunTest, PortInUseIsReported) {
  // Hold a listening socket on a port, then ask ddprun for that port.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  // On one node, most likely another job on the default port: the line says
  // what to do.
  const std::string in_use = "cannot serve the rendezvous store: cannot listen on 127.0.0.1:" + port +
                             ": Address already in use: another process on this host already listens on "
                             "127.0.0.1:" + port +
                             " (a second process started as rank 0 of a job whose rank 0 serves the store, a "
                             "store left running by an earlier job, or another program holding MASTER_PORT " +
                             port + "); check RANK and MASTER_PORT";
  ExpectBadInput({Ddprun(), "--master_port=" + port, Worker()},
                 in_use + "; another job on this host may hold the port: give another --master_port, or "
                          "--standalone (a free port)");
  // A c10d launcher told to serve (torchrun's is_host) does not join instead.
  ExpectBadInput({Ddprun(), "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                  "--rdzv_conf=is_host=true", Worker()},
                 in_use, {{"DDP_JOB_TOKEN", "t"}});
  close(fd);
}


// What fails for the system, not for what the user gave, exits 1 as any
// failed job does, not 2 (bad input), which tells a script or scheduler
// that retrying the same command is pointless: a store that cannot start
// for lack of descriptors, a temporary folder that cannot be made (TMPDIR
// is no flag). A --log_dir that cannot be made stays bad input.
TEST(DdprunTest, SystemFailuresBeforeTheStartAreNoBadInput) {
  const std::string dir = testing::MakeTempDir("ddprun_system_failures");
  // Four descriptors: the listening socket takes the last one free.
  auto run = RunProgram({"/bin/sh", "-c", "ulimit -n 4 && exec \"$0\" --master_port=0 /bin/true", Ddprun()});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ddprun: cannot serve the rendezvous store: "));
  EXPECT_THAT(run.output, HasSubstr(": Too many open files"));
  const std::string file = dir + "/a_file";
  std::ofstream(file) << "x";
  run = RunProgram({Ddprun(), "--standalone", "--redirects=3", "/bin/true"}, {{"TMPDIR", file}});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ddprun: cannot create a temporary folder for the logs of --tee/--redirects ('" +
                                    file + "/torchelastic_"));
  EXPECT_THAT(run.output, HasSubstr("'): Not a directory; give --log_dir=DIR\n"));
  ExpectBadInput({Ddprun(), "--standalone", "--log_dir=" + file + "/logs", "/bin/true"},
                 "cannot create --log_dir '" + file + "/logs': Not a directory");
}

// A restart whose workers cannot start (the program was removed meanwhile)
// says that it is the restart that failed, after the line that announced
// it; the start error alone read as if the job had never started. Exit 1:
// the job had run.
TEST(DdprunTest, ARestartThatCannotStartSaysSo) {
  const std::string dir = testing::MakeTempDir("ddprun_restart_cannot_start");
  const std::string script = dir + "/train.sh";
  std::ofstream(script) << "#!/bin/sh\nrm -f \"$0\"\nexit 3\n";
  ASSERT_EQ(chmod(script.c_str(), 0755), 0);
  const auto run = RunProgram({Ddprun(), "--standalone", "--max_restarts=2", script});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("exited with code 3; restarting the job (restart 1 of 2)\n"));
  EXPECT_THAT(run.output, HasSubstr("ddprun: the restart (attempt 1) could not start the workers: cannot start "
                                    "rank 0: exec '" + script + "': No such file or directory\n"))
      << run.output;
}

// ---- a terminal of its own: a pseudo-terminal session ----

// `argv` run in a new session whose controlling terminal is a fresh
// pseudo-terminal (stdin, stdout and stderr); the test holds the other end.
struct PtySession {
  pid_t pid = -1;
  int master = -1;
  std::string output;  // everything the terminal showed so far

  explicit PtySession(const std::vector<std::string>& argv) {
    master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) return;
    const std::string slave = ptsname(master);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls from here on.
      setsid();
      const int fd = open(slave.c_str(), O_RDWR);
      if (fd < 0 || ioctl(fd, TIOCSCTTY, 0) != 0) _exit(126);
      dup2(fd, 0);
      dup2(fd, 1);
      dup2(fd, 2);
      if (fd > 2) close(fd);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  ~PtySession() {
    if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0) {
      kill(-pid, SIGKILL);  // the session's first group; its workers die with their launcher
      waitpid(pid, nullptr, 0);
    }
    if (master >= 0) close(master);
  }

  // Reads what the terminal shows until `needle` is in it, at `from` or
  // after (true), or `timeout` passes or the session ends (false).
  bool ReadUntil(const std::string& needle, size_t from = 0, std::chrono::milliseconds timeout = 20s) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    while (output.find(needle, from) == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          give_up - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{master, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buffer[4096];
      const ssize_t n = read(master, buffer, sizeof(buffer));
      if (n <= 0) return output.find(needle, from) != std::string::npos;  // EIO: every holder closed it
      output.append(buffer, static_cast<size_t>(n));
    }
    return true;
  }
  void Type(const std::string& text) {
    ASSERT_EQ(write(master, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  }

  // The session leader's exit status (128 + signal when killed), after up
  // to 20 s; -1 when it did not end.
  int Wait() {
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= give_up) return -1;
      ReadUntil("\x01", 0, 100ms);  // drains the terminal meanwhile
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

// A worker that says it runs, then reads a line from its stdin and shows it.
constexpr char kReadALine[] = " /bin/sh -c 'echo ready; read line; echo got:$line'";

// A shell line that runs ddprun and then says its exit status and whether
// the terminal's foreground group is the shell's own again: /bin/sh -c has
// no job control, so ddprun runs in the shell's group, its caller's.
std::string ThenReportTheTerminal(const std::string& ddprun_line) {
  return ddprun_line + "; echo rc=$?; set -- $(cat /proc/$$/stat); echo \"group=$5 foreground=$8.\"";
}

void ExpectTheTerminalIsTheCallers(PtySession& session) {
  ASSERT_TRUE(session.ReadUntil("foreground=")) << session.output;
  ASSERT_TRUE(session.ReadUntil(".\r\n", session.output.find("foreground="))) << session.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(session.output, m, std::regex("group=([0-9]+) foreground=([0-9]+)\\.")))
      << session.output;
  EXPECT_EQ(m[1].str(), m[2].str()) << session.output;
}

// As under torchrun, whose workers share its process group: a worker reads
// the terminal ddprun runs in (a debugger, input()), and once the job is
// over the terminal is its caller's again. On the old code the worker was
// stopped by SIGTTIN, and the job failed.
TEST(DdprunTest, AWorkerReadsTheTerminal) {
  PtySession session({"/bin/sh", "-c",
                      ThenReportTheTerminal(Ddprun() + " --standalone --nproc_per_node=1" + kReadALine)});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("ready")) << session.output;
  session.Type("hello\n");
  EXPECT_TRUE(session.ReadUntil("got:hello")) << session.output;
  EXPECT_TRUE(session.ReadUntil("rc=0")) << session.output;
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
  EXPECT_THAT(session.output, Not(HasSubstr("SIGTTIN")));
}

// Ctrl-C reaches the workers, which hold the terminal; ddprun reads it off
// them and stops the job as interrupted (no restart, 128 + SIGINT), and
// passes it to its own group, as the terminal would have: its caller there
// (a shell whose trap here says so) gets it, so that a script looping over
// launches stops at Ctrl-C, as under torchrun. The terminal goes back.
TEST(DdprunTest, CtrlCAtTheTerminalStopsTheJobWithoutARestart) {
  PtySession session({"/bin/sh", "-c",
                      "trap 'echo caller got SIGINT' INT; " +
                          ThenReportTheTerminal(Ddprun() + " --standalone --nproc_per_node=2 --max_restarts=2" +
                                                kReadALine)});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("[0] ready")) << session.output;
  ASSERT_TRUE(session.ReadUntil("[1] ready")) << session.output;
  session.Type("\x03");
  EXPECT_TRUE(session.ReadUntil("caller got SIGINT")) << session.output;
  EXPECT_TRUE(session.ReadUntil("rc=130")) << session.output;
  EXPECT_THAT(session.output, HasSubstr("interrupted by SIGINT from the terminal"));
  EXPECT_THAT(session.output, Not(HasSubstr("restart")));
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

// A worker that catches Ctrl-C itself and exits 1 (a program's own
// handler): it was still the terminal's interrupt, which under torchrun
// reaches the launcher too and ends the job. On the old code ddprun saw
// only a worker that exited 1, and restarted the job.
TEST(DdprunTest, CtrlCEndsTheJobWithoutARestartAlsoWhenTheWorkersCatchIt) {
  PtySession session({"/bin/sh", "-c",
                      "trap 'echo caller got SIGINT' INT; " +
                          ThenReportTheTerminal(Ddprun() +
                                                " --standalone --nproc_per_node=2 --max_restarts=2 /bin/sh -c "
                                                "'trap \"echo caught; exit 1\" INT; echo ready; "
                                                "while :; do sleep 1; done'")});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("[0] ready")) << session.output;
  ASSERT_TRUE(session.ReadUntil("[1] ready")) << session.output;
  session.Type("\x03");
  EXPECT_TRUE(session.ReadUntil("caller got SIGINT")) << session.output;
  EXPECT_TRUE(session.ReadUntil("rc=130")) << session.output;
  EXPECT_THAT(session.output, HasSubstr("interrupted by SIGINT from the terminal"));
  EXPECT_THAT(session.output, Not(HasSubstr("restart")));
  EXPECT_EQ(CountLines(session.output, "ready"), 2) << session.output;
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

// ddprun killed by SIGTERM while a worker waits for a line from the
// terminal: the worker ends, and the terminal is the caller's again.
TEST(DdprunTest, SigtermWhileAWorkerReadsTheTerminalGivesTheTerminalBack) {
  PtySession session({"/bin/sh", "-c",
                      ThenReportTheTerminal(Ddprun() +
                                            " --standalone --nproc_per_node=1 /bin/sh -c "
                                            "'echo \"ready $PPID.\"; read line; echo got:$line'")});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("ready ")) << session.output;
  ASSERT_TRUE(session.ReadUntil(".")) << session.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(session.output, m, std::regex("ready ([0-9]+)\\."))) << session.output;
  // The worker's parent is ddprun.
  ASSERT_EQ(kill(std::stoi(m[1].str()), SIGTERM), 0);
  EXPECT_TRUE(session.ReadUntil("rc=143")) << session.output;
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
  EXPECT_THAT(session.output, Not(HasSubstr("SIGTTIN")));
}

// `ddprun` (a ddprun binary) killed by SIGKILL while its worker holds the
// terminal: the watcher of the workers' group gives the terminal back to
// ddprun's group (here the shell's) as it kills the workers. The shell
// polls for that (it happens just after ddprun's end), for up to 5 s.
void SigkillGivesTheTerminalBack(const std::string& ddprun_binary) {
  PtySession session({"/bin/sh", "-c",
                      ddprun_binary +
                          " --standalone --nproc_per_node=1 /bin/sh -c "
                          "'echo \"ready $PPID.\"; read line; echo got:$line; read line'; echo rc=$?; "
                          "i=0; while [ $i -lt 100 ]; do set -- $(cat /proc/$$/stat); "
                          "[ \"$5\" = \"$8\" ] && break; i=$((i + 1)); sleep 0.05; done; "
                          "echo \"group=$5 foreground=$8.\""});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("ready ")) << session.output;
  ASSERT_TRUE(session.ReadUntil(".")) << session.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(session.output, m, std::regex("ready ([0-9]+)\\."))) << session.output;
  const pid_t ddprun = std::stoi(m[1].str());  // the worker's parent; before the output grows
  session.Type("hello\n");
  ASSERT_TRUE(session.ReadUntil("got:hello")) << session.output;
  ASSERT_EQ(kill(ddprun, SIGKILL), 0);
  EXPECT_TRUE(session.ReadUntil("rc=137")) << session.output;
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

TEST(DdprunTest, SigkillOfDdprunGivesTheTerminalBack) { SigkillGivesTheTerminalBack(Ddprun()); }

// The first worker takes the terminal before its exec, and ddprun may be
// killed right after that: its watcher must already be there. Here ddprun
// pauses after starting the first worker (ddprun_pausing) and is killed
// then. The watcher used to start after the first worker, so none was
// there, and the terminal stayed with the dead workers' group (under
// ThreadSanitizer, SigkillOfDdprunGivesTheTerminalBack failed so, a few
// runs in twelve).
TEST(DdprunTest, SigkillRightAfterTheFirstWorkerStartedGivesTheTerminalBack) {
  SigkillGivesTheTerminalBack(testing::Runfile("transport/launch/ddprun_pausing"));
}

// The first worker takes the terminal before its exec; one whose exec
// fails (a file that is neither a binary nor a script) must not leave the
// terminal to its dead group.
TEST(DdprunTest, AWorkerThatCannotStartLeavesTheTerminalToTheCaller) {
  const std::string garbage = testing::MakeTempDir("ddprun_pty_garbage") + "/not_a_program";
  {
    std::ofstream file(garbage);
    file << "garbage\x01\x02\n";
  }
  ASSERT_EQ(chmod(garbage.c_str(), 0755), 0);
  PtySession session(
      {"/bin/sh", "-c", ThenReportTheTerminal(Ddprun() + " --standalone --nproc_per_node=2 " + garbage)});
  ASSERT_GT(session.pid, 0);
  EXPECT_TRUE(session.ReadUntil("rc=2")) << session.output;
  EXPECT_THAT(session.output, HasSubstr("Exec format error"));
  ExpectTheTerminalIsTheCallers(session);
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

// In an interactive bash, runs ddprun with one worker running `worker` (a
// shell line that prints "ready", reads a line and prints "got:" and it),
// stops the job with Ctrl-Z and continues it with `fg`: the shell reports
// the job stopped, and the worker then reads its line from the terminal.
void CtrlZThenFgReadsALine(const std::string& worker) {
  PtySession session({"/usr/bin/env", "PS1=prompt$ ", "/bin/bash", "--norc", "--noprofile", "-i"});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("prompt$ ")) << session.output;
  session.Type(Ddprun() + " --standalone --nproc_per_node=1" + worker + "\n");
  ASSERT_TRUE(session.ReadUntil("ready\r\n")) << session.output;
  session.Type("\x1a");
  ASSERT_TRUE(session.ReadUntil("Stopped")) << session.output;
  ASSERT_TRUE(session.ReadUntil("prompt$ ", session.output.find("Stopped"))) << session.output;
  const size_t before_fg = session.output.size();
  session.Type("fg\n");
  // bash names the job it continues; the line then waits in the terminal
  // until the worker reads it.
  ASSERT_TRUE(session.ReadUntil("got:$line'", before_fg)) << session.output;
  session.Type("hello\n");
  EXPECT_TRUE(session.ReadUntil("got:hello")) << session.output;
  session.Type("echo rc=$?.\n");
  EXPECT_TRUE(session.ReadUntil("rc=0.")) << session.output;
  session.Type("exit\n");
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

// Ctrl-Z in an interactive shell (job control): the workers stop, ddprun
// gives the terminal back and stops, and the shell reports the job stopped;
// `fg` gives the workers the terminal again, and the worker reads its line.
TEST(DdprunTest, CtrlZStopsTheJobAndFgContinuesIt) { CtrlZThenFgReadsALine(kReadALine); }

// Ctrl-Z stops the job when the workers ignore SIGTSTP too: ddprun hears
// the terminal's signal itself (at once), as a shell stops a job whatever
// its processes do with it. On the old code ddprun looked only for a
// worker stopped by SIGTSTP (once a second), and the job ran on.
TEST(DdprunTest, CtrlZStopsTheJobAlsoWhenTheWorkersIgnoreIt) {
  CtrlZThenFgReadsALine(" /bin/sh -c 'trap \"\" TSTP; echo ready; read line; echo got:$line'");
}

// Ctrl-Z, `bg`, then `fg`: the workers get the terminal again and the
// worker reads its line. In the background, its read stops it (SIGTTIN),
// and ddprun stops the job as a shell's background job is stopped, until
// `fg`. On the old code the workers never got the terminal back after
// `bg`, and the read failed the job ("stopped by SIGTTIN").
TEST(DdprunTest, FgAfterBgGivesTheWorkersTheTerminalAgain) {
  PtySession session({"/usr/bin/env", "PS1=prompt$ ", "/bin/bash", "--norc", "--noprofile", "-i"});
  ASSERT_GT(session.pid, 0);
  ASSERT_TRUE(session.ReadUntil("prompt$ ")) << session.output;
  session.Type(Ddprun() + " --standalone --nproc_per_node=1" + kReadALine + "\n");
  ASSERT_TRUE(session.ReadUntil("ready\r\n")) << session.output;
  session.Type("\x1a");
  ASSERT_TRUE(session.ReadUntil("Stopped")) << session.output;
  ASSERT_TRUE(session.ReadUntil("prompt$ ", session.output.find("Stopped"))) << session.output;
  size_t before = session.output.size();
  session.Type("bg\n");
  ASSERT_TRUE(session.ReadUntil("&", before)) << session.output;
  ASSERT_TRUE(session.ReadUntil("prompt$ ", before)) << session.output;
  before = session.output.size();
  session.Type("fg\n");
  ASSERT_TRUE(session.ReadUntil("got:$line'", before)) << session.output;
  session.Type("hello\n");
  EXPECT_TRUE(session.ReadUntil("got:hello")) << session.output;
  session.Type("echo rc=$?.\n");
  EXPECT_TRUE(session.ReadUntil("rc=0.")) << session.output;
  EXPECT_THAT(session.output, Not(HasSubstr("SIGTTIN")));
  session.Type("exit\n");
  EXPECT_EQ(session.Wait(), 0) << session.output;
}

}  // namespace
}  // namespace ddp::transport::launch
