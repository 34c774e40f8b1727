// A checkpoint write killed at any point never leaves a file that loads as
// something wrong: the previous checkpoint or the new one, never a mix, a
// prefix or garbage.
//
// Every checkpoint written here is a function of one number, its
// generation: every element of every tensor and the metadata follow from
// it, so a file that mixed two saves, or held a torn tensor, is caught by
// checking each element against the generation the metadata claims.
//
//   KillAtEvenlySpacedPointsOfOneSave: one process saves (nn/io), killed
//     at 24 instants spread over the save's duration (data written, fsync,
//     rename, folder fsync), at 3 later ones, and at 7 points of the data
//     (once the temporary file holds 1/8 ... 7/8 of it).
//   KillRanksInALoopDuringDdpSaves: two ranks save through ddp's rank-0
//     path in a loop; a rank (the writer or the other) is killed with
//     SIGKILL at a random moment (the writer: in the middle of writing its
//     temporary file), round after round.

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/checkpoint.h"
#include "ddp/process_group.h"
#include "nn/data/test_files.h"
#include "nn/io/atomic_file.h"
#include "nn/io/checkpoint.h"
#include "nn/modules/layers.h"
#include "nn/tensor/tensor.h"
#include "transport/launch/launch_test_util.h"
#include "transport/launch/test_spawn.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;
namespace lt = transport::launch::testing;
using nn::data::testing::WaitChild;

// Element i of tensor k in generation g; exact in f32 for the sizes used.
float Value(int64_t gen, size_t k, int64_t i) {
  return static_cast<float>(gen * 1024 + static_cast<int64_t>(k) * 16 + i % 13);
}

// A model of about 8 MiB of parameters: big enough that a save takes a
// while, so kills land inside it.
std::shared_ptr<nn::modules::Sequential> Model() {
  return std::make_shared<nn::modules::Sequential>(std::initializer_list<std::shared_ptr<nn::modules::Module>>{
      std::make_shared<nn::modules::Linear>(1024, 1024),
      std::make_shared<nn::modules::Linear>(1024, 512),
      std::make_shared<nn::modules::Linear>(512, 10)});
}

void SetGeneration(nn::modules::Module& model, int64_t gen) {
  nn::NoGradGuard no_grad;
  size_t k = 0;
  for (auto& [name, p] : model.NamedParameters()) {
    float* data = p.data<float>();
    for (int64_t i = 0; i < p.numel(); ++i) data[i] = Value(gen, k, i);
    ++k;
  }
}

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name + "_" +
                          std::to_string(getpid());
  mkdir(dir.c_str(), 0700);
  return dir;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The size of the temporary file (nn/io's `<name>.tmp.<pid>.<n>.<host>`)
// that process `pid` is writing, or left, beside `path`; -1 when there is
// none.
int64_t TemporarySizeOf(const std::string& path, pid_t pid) {
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash);
  const std::string prefix = path.substr(slash + 1) + ".tmp." + std::to_string(pid) + ".";
  for (const std::string& name : ListDir(dir)) {
    if (name.rfind(prefix, 0) != 0) continue;
    struct stat st{};
    if (stat((dir + "/" + name).c_str(), &st) == 0) return st.st_size;
  }
  return -1;
}

// Loads `path` and checks that it is exactly one generation: the one its
// metadata names. Returns that generation; fails the test otherwise.
int64_t LoadAndCheck(const std::string& path) {
  nn::io::Checkpoint c;
  try {
    c = nn::io::LoadCheckpoint(path);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the checkpoint does not load: " << e.what();
    return -1;
  }
  const int64_t gen = nn::io::MetadataInt(c.metadata, "gen", path);
  // Strict load into a fresh model: every key, shape and dtype present.
  auto model = Model();
  model->LoadStateDict(c.model);
  size_t k = 0;
  for (auto& [name, p] : model->NamedParameters()) {
    const float* data = p.data<float>();
    for (int64_t i = 0; i < p.numel(); ++i) {
      if (data[i] != Value(gen, k, i)) {
        ADD_FAILURE() << path << ": " << name << "[" << i << "] is " << data[i]
                      << ", generation " << gen << " has " << Value(gen, k, i);
        return -1;
      }
    }
    ++k;
  }
  return gen;
}

nn::io::Checkpoint MakeGeneration(nn::modules::Module& model, int64_t gen) {
  SetGeneration(model, gen);
  return dist::MakeCheckpoint(model, nullptr, {{"gen", std::to_string(gen)}});
}

// ---------------------------------------------------------- one process ----

TEST(CheckpointKill, KillAtEvenlySpacedPointsOfOneSave) {
  const std::string dir = TempDir("ckpt_points");
  const std::string path = dir + "/model.safetensors";
  auto model = Model();
  nn::io::SaveCheckpoint(path, MakeGeneration(*model, 1));

  // Runs a save of generation `gen` in a forked child that starts when
  // told, kills it `at` after that (never, when negative), and returns
  // whether it was killed before it finished, how long it ran, and the
  // size of the temporary file it left (-1 when none: killed before it
  // made one or after the rename, or not killed).
  struct Outcome {
    bool killed;
    double seconds;
    int64_t temporary_size;
  };
  // With `kill_at_bytes` > 0 (and `at` negative), the kill comes once the
  // writer's temporary file holds that many bytes.
  const auto save_in_child = [&](int64_t gen, double at, int64_t kill_at_bytes = 0) -> Outcome {
    const nn::io::Checkpoint c = MakeGeneration(*model, gen);  // built before the fork
    int go[2];
    EXPECT_EQ(pipe(go), 0);
    const pid_t child = fork();
    if (child == 0) {
      char byte;
      if (read(go[0], &byte, 1) != 1) _exit(3);
      // Aimed at the data: each piece (one per tensor) waits a little
      // first, so that the kill, once the file holds enough, finds the
      // rest still to come rather than written in the same instant.
      if (kill_at_bytes > 0) nn::io::internal::SetWritePausePerPiece(10ms);
      nn::io::SaveCheckpoint(path, c);
      _exit(0);
    }
    close(go[0]);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(write(go[1], "g", 1), 1);
    int status = 0;
    bool reaped = false;
    if (at >= 0) {
      // Spins (for a precise instant), but stops once the child has ended:
      // spinning on past that would only take a core from the next saves.
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < at) {
        if (waitpid(child, &status, WNOHANG) == child) {
          reaped = true;
          break;
        }
      }
      if (!reaped) kill(child, SIGKILL);
    }
    if (at < 0 && kill_at_bytes > 0) {
      // Watches the temporary file and kills the writer once it holds
      // `kill_at_bytes` (or it ends first).
      const auto until = start + 120s;
      while (std::chrono::steady_clock::now() < until) {
        if (waitpid(child, &status, WNOHANG) == child) {
          reaped = true;
          break;
        }
        if (TemporarySizeOf(path, child) >= kill_at_bytes) break;
      }
      if (!reaped) kill(child, SIGKILL);
    }
    if (!reaped) status = WaitChild(child, 120s);
    close(go[1]);
    // A writer killed by SIGKILL leaves its temporary file as it was at the
    // kill (the next save removes it); one that finished renamed it.
    return {WIFSIGNALED(status),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            TemporarySizeOf(path, child)};
  };

  // How long a save takes in a child (page faults of the copied address
  // space included): the median of three.
  int64_t last = 1;
  std::vector<double> times;
  for (int i = 0; i < 3; ++i) {
    times.push_back(save_in_child(++last, -1).seconds);
    ASSERT_EQ(LoadAndCheck(path), last);
  }
  std::sort(times.begin(), times.end());
  const double save_s = times[1];
  struct stat full{};
  ASSERT_EQ(stat(path.c_str(), &full), 0);

  // Kills spread from the start of the save to well past its end (three
  // median saves: one save can take twice the median on a busy machine or
  // under a sanitizer; seen: all of 24 kills within 1.5 medians landed
  // before the writer finished under TSan), then a few later ones, up to 20
  // medians and at least 10 s: under CI's load (several tests on 2 cores)
  // the saves after the calibrating ones can run several times slower, and
  // a kill that comes after the save finished must be among the points. A
  // save that ends before its kill time ends the wait for it.
  constexpr int kPoints = 24;
  const std::vector<double> late_points = {save_s * 5, save_s * 10, std::max(save_s * 20, 10.0)};
  // Then kills aimed at the data itself, wherever the save's timing puts it:
  // once the temporary file holds 1/8, 2/8, ... 7/8 of the bytes (with a
  // 10 ms pause before each tensor's write, in these saves only).
  constexpr int kDataPoints = 7;
  const int points = kPoints + static_cast<int>(late_points.size()) + kDataPoints;
  int old_kept = 0, new_kept = 0, killed_in_save = 0;
  // Kills that found the writer with its temporary file begun (data
  // written, not yet renamed), and of those, with part of the data only.
  int mid_write = 0, mid_data = 0;
  for (int point = 0; point < points; ++point) {
    const int64_t next = last + 1;
    const int data_point = point - kPoints - static_cast<int>(late_points.size());
    const double at = point < kPoints                 ? save_s * 3.0 * point / (kPoints - 1)
                      : data_point < 0                ? late_points[point - kPoints]
                                                      : -1;
    const int64_t kill_at_bytes =
        data_point < 0 ? 0 : std::max<int64_t>(1, full.st_size * (data_point + 1) / (kDataPoints + 1));
    const Outcome outcome = save_in_child(next, at, kill_at_bytes);
    killed_in_save += outcome.killed;
    const bool writing = outcome.killed && outcome.temporary_size > 0;
    if (writing) {
      ++mid_write;
      mid_data += outcome.temporary_size < full.st_size;
    }
    const int64_t gen = LoadAndCheck(path);
    const std::string where = data_point < 0
                                  ? "kill at " + std::to_string(at * 1e3) + " ms"
                                  : "kill at " + std::to_string(kill_at_bytes) + " bytes written";
    ASSERT_TRUE(gen == last || gen == next)
        << where << ": generation " << gen << ", expected " << last << " or " << next;
    // Killed with the new file not yet renamed: the previous one stays.
    if (writing) {
      EXPECT_EQ(gen, last) << where << ", with " << outcome.temporary_size
                           << " bytes in the temporary file";
    }
    (gen == last ? old_kept : new_kept) += 1;
    last = gen;
  }
  std::printf("a save takes %.1f ms in a child; of %d kills, %d landed before the writer "
              "finished, %d of them with its temporary file begun (%d with part of the %lld "
              "bytes written); the previous checkpoint was left %d times, the new one %d "
              "times\n",
              save_s * 1e3, points, killed_in_save, mid_write, mid_data,
              static_cast<long long>(full.st_size), old_kept, new_kept);
  // The kills spanned the save: some came before it finished, some after,
  // and some while the new file was being written (not only before the
  // writer began or after it renamed).
  EXPECT_GT(old_kept, 0);
  EXPECT_GT(new_kept, 0);
  EXPECT_GT(mid_write, 0) << "no kill landed while the temporary file was being written";
  EXPECT_GT(mid_data, 0) << "no kill landed with part of the data written";
  // Killed writers leave temporaries beside the checkpoint, never in its
  // place; the next successful save removes them.
  for (const std::string& name : ListDir(dir)) {
    EXPECT_TRUE(name == "model.safetensors" || name.rfind("model.safetensors.tmp.", 0) == 0)
        << name;
  }
  nn::io::SaveCheckpoint(path, MakeGeneration(*model, last + 1));
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(LoadAndCheck(path), last + 1);
}

// ----------------------------------------------------------- ddp ranks ----

// Saves generation after generation through ddp's collective save (rank 0
// writes). Starts after the generation already on disk.
DDP_TEST_WORKER(saver) {
  const std::string dir = std::getenv("KILL_TEST_DIR");
  const std::string path = dir + "/ddp.safetensors";
  {
    const int rank = std::atoi(std::getenv("RANK"));
    std::ofstream(dir + "/rank" + std::to_string(rank) + ".pid.tmp") << getpid();
    std::rename((dir + "/rank" + std::to_string(rank) + ".pid.tmp").c_str(),
                (dir + "/rank" + std::to_string(rank) + ".pid").c_str());
  }
  dist::ProcessGroupOptions options;
  options.timeout = 5s;
  auto pg = dist::ProcessGroup::CreateFromEnvironment(options);
  auto model = Model();
  int64_t gen = nn::io::MetadataInt(nn::io::LoadCheckpoint(path).metadata, "gen", path);
  for (int i = 0; i < 1000; ++i) {
    ++gen;
    dist::SaveCheckpoint(*pg, path, MakeGeneration(*model, gen));
  }
  return 0;
}

// The generation the file on disk holds now (-1 while unreadable).
int64_t GenerationOnDisk(const std::string& path) {
  try {
    return nn::io::MetadataInt(nn::io::LoadCheckpoint(path).metadata, "gen", path);
  } catch (const std::exception&) {
    return -1;
  }
}

pid_t WaitForPid(const std::string& file, std::chrono::steady_clock::time_point until) {
  while (std::chrono::steady_clock::now() < until) {
    pid_t pid = 0;
    std::ifstream(file) >> pid;
    if (pid > 0) return pid;
    std::this_thread::sleep_for(2ms);
  }
  return -1;
}

// Sends SIGKILL to `pid` only while it is a child of this process (a rank
// of the run under way), never to a process that took the pid after the
// run reaped the rank: the pidfd pins one process before its parent is
// looked up, and a signal through it to a process gone since fails.
// Returns "" when the signal was sent, else why not.
std::string KillOwnChild(pid_t pid) {
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return "pidfd_open(" + std::to_string(pid) + "): " + std::strerror(errno);
  std::string why_not;
  if (const pid_t parent = lt::ParentPid(pid); parent != getpid()) {
    why_not = "pid " + std::to_string(pid) + " is no child of this process (its parent: " +
              std::to_string(parent) + ")";
  } else if (syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0) != 0) {
    why_not = "pidfd_send_signal(" + std::to_string(pid) + "): " + std::strerror(errno);
  }
  close(fd);
  return why_not;
}

TEST(CheckpointKill, KillRanksInALoopDuringDdpSaves) {
  const std::string dir = TempDir("ckpt_ddp");
  const std::string path = dir + "/ddp.safetensors";
  {
    auto model = Model();
    nn::io::SaveCheckpoint(path, MakeGeneration(*model, 1));
  }
  std::mt19937 rng(7);
  int64_t last = 1;
  int advanced = 0, writer_rounds = 0, killed_writing = 0;
  constexpr int kRounds = 6;
  for (int round = 0; round < kRounds; ++round) {
    const int victim = round % 2;  // the writer, then the other rank
    for (int r = 0; r < 2; ++r) std::remove((dir + "/rank" + std::to_string(r) + ".pid").c_str());
    // Why the victim was not killed ("" once it was); read after the join.
    std::string not_killed = "the victim's pid file did not come";
    // Size of the temporary file the killed writer was writing, or -1.
    std::atomic<int64_t> temporary_size{-1};
    // One deadline for all the killer's waits, inside the run's 60 s: past
    // the run, its ranks are reaped and their pids free for other processes.
    const auto round_end = std::chrono::steady_clock::now() + 50s;
    std::thread killer([&] {
      const pid_t pid = WaitForPid(dir + "/rank" + std::to_string(victim) + ".pid", round_end);
      if (pid <= 0) return;
      // Once this round has saved (setup time varies with the machine's
      // load), saves follow each other; a random delay of a few saves lands
      // the kill anywhere in one of them.
      while (std::chrono::steady_clock::now() < round_end && GenerationOnDisk(path) <= last) {
        std::this_thread::sleep_for(5ms);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 300));
      // The writer is killed in the middle of writing a file: once its
      // next temporary file has data (bounded: past that, wherever it is).
      // Looks every 1 ms, leaving the cores to the two ranks.
      if (victim == 0) {
        const auto write_until = std::min(std::chrono::steady_clock::now() + 10s, round_end);
        while (std::chrono::steady_clock::now() < write_until && TemporarySizeOf(path, pid) <= 0) {
          std::this_thread::sleep_for(1ms);
        }
      }
      if (std::chrono::steady_clock::now() >= round_end) {
        not_killed = "the round's 50 s were over before the kill";
        return;
      }
      not_killed = KillOwnChild(pid);
      if (victim == 0) temporary_size = TemporarySizeOf(path, pid);
    });
    lt::TestRunOptions options;
    options.world_size = 2;
    options.timeout = 60s;
    options.echo_output = false;
    options.env = {{"KILL_TEST_DIR", dir}};
    auto run = lt::RunTestWorkers("saver", options);
    killer.join();
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(not_killed, "") << "round " << round << ": the victim was not killed\n" << run->Summary();
    EXPECT_EQ(run->ExitCode(victim), 128 + SIGKILL) << run->Summary();
    const int64_t gen = LoadAndCheck(path);
    ASSERT_GE(gen, last) << "round " << round << ": an older checkpoint came back";
    advanced += gen > last;
    if (victim == 0) {
      ++writer_rounds;
      killed_writing += temporary_size.load() > 0;
    }
    std::printf("round %d: killed rank %d; checkpoint at generation %lld; temporary file %lld "
                "bytes\n",
                round, victim, static_cast<long long>(gen),
                static_cast<long long>(temporary_size.load()));
    last = gen;
  }
  // Every round saved before its kill (the test exercised the save path).
  EXPECT_EQ(advanced, kRounds);
  // The writer's kills came while it wrote a temporary file (it may have
  // renamed it in the instant between the look and the kill, rarely).
  EXPECT_GT(killed_writing, 0) << "of " << writer_rounds << " kills of the writer";
  for (const std::string& name : ListDir(dir)) {
    EXPECT_TRUE(name == "ddp.safetensors" || name.rfind("ddp.safetensors.tmp.", 0) == 0 ||
                name.rfind("rank", 0) == 0)
        << name;
  }
}

}  // namespace
}  // namespace ddp
