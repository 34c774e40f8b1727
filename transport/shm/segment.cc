#include "transport/shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <optional>
#include <random>
#include <sstream>
#include <string_view>

#include "transport/file_text.h"

namespace ddp::transport::shm {
namespace {

// Where a rank would post that it has the segment, a rank that could not
// create or map it posts why, after this mark (names start with '/').
constexpr char kFailed = '!';

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// What every rank of the group returns when local rank `rank` could not
// create or map the segment (UNAVAILABLE: the caller goes without it).
Status GroupFailure(int rank, const std::string& reason) {
  return UnavailableError("shared-memory segment unavailable: local rank " + std::to_string(rank) +
                          ": " + reason);
}

// A segment's name lives from its creation until every rank mapped it,
// within set-up's deadline, which the caller sets (a communicator's timeout
// may be half an hour or more). The name carries that deadline (wall-clock
// seconds): past it every rank has mapped the name or given up, and rank 0,
// if alive, has unlinked it. A name whose creator is gone counts as stale
// only past the deadline it carries (and kDeadlineSlackS more), and at
// least the stale age old (RemoveStaleSegments). Death alone is not enough
// because of pid namespaces: a creator in another one (a container sharing
// this /dev/shm) may look dead here, or its pid belong to another process
// here, while its slow ranks still open the name. Names without a deadline
// (older versions) go by the stale age alone.
constexpr long long kDeadlineSlackS = 60;

// The parts of a segment name "ddp-<pid>-<number>-<deadline>" (as
// CreateShared names them; older versions left out "-<deadline>").
struct SegmentName {
  pid_t creator = -1;       // -1: not a segment name
  long long deadline = -1;  // wall-clock seconds since the epoch; -1: none given
};

SegmentName ParseName(std::string_view name) {
  auto number = [](std::string_view s, long long& value) {
    if (s.empty() || s.size() > 18 ||
        !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return false;
    }
    std::from_chars(s.data(), s.data() + s.size(), value);
    return true;
  };
  SegmentName parsed;
  if (!name.starts_with("ddp-")) return parsed;
  name.remove_prefix(4);
  const size_t dash = name.find('-');
  long long pid = 0, random = 0, deadline = -1;
  if (dash == std::string_view::npos || dash > 9 || !number(name.substr(0, dash), pid) || pid <= 0) {
    return parsed;
  }
  std::string_view rest = name.substr(dash + 1);
  const size_t second = rest.find('-');
  if (second != std::string_view::npos) {
    if (!number(rest.substr(second + 1), deadline)) return parsed;
    rest = rest.substr(0, second);
  }
  if (!number(rest, random)) return parsed;
  parsed.creator = static_cast<pid_t>(pid);
  parsed.deadline = deadline;
  return parsed;
}

// `deadline` as wall-clock seconds since the epoch, rounded up; one too far
// ahead to say (Deadline::max()) is a century from now.
long long WallClockSeconds(Deadline deadline) {
  using std::chrono::seconds;
  constexpr seconds kFarAhead{100LL * 365 * 24 * 3600};
  const Deadline now = Clock::now();
  const seconds left = deadline <= now                ? seconds(0)
                       : deadline - now >= kFarAhead ? kFarAhead
                                                     : std::chrono::ceil<seconds>(deadline - now);
  return static_cast<long long>(std::time(nullptr)) + left.count() + 1;
}

// Whether the process `pid` still is the one that last modified a file at
// `modified` (seconds since the epoch): it exists, is not a zombie, and
// started no later (to the second /proc gives). A process that cannot be
// read counts as the creator: only a clear sign of death removes a name.
bool CreatorAlive(pid_t pid, time_t modified) {
  // EPERM: alive, another user's.
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  const std::optional<std::string> stat_text = ReadWholeFile("/proc/" + std::to_string(pid) + "/stat");
  if (!stat_text || stat_text->empty()) return true;
  const std::string stat = stat_text->substr(0, stat_text->find('\n'));
  // "<pid> (<comm>) <state> <ppid> ...": comm may hold spaces and ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return true;
  std::istringstream fields(stat.substr(close + 1));
  std::string state;
  fields >> state;
  if (state == "Z" || state == "X") return false;
  // starttime is the 22nd field: clock ticks since boot, after the 18
  // fields from ppid (the 4th) to itrealvalue (the 21st).
  std::string field;
  for (int i = 0; i < 18 && (fields >> field); ++i) {
  }
  unsigned long long start_ticks = 0;
  if (!(fields >> start_ticks)) return true;
  std::istringstream proc_stat(ReadWholeFile("/proc/stat").value_or(""));
  long long boot = -1;
  for (std::string line; std::getline(proc_stat, line);) {
    if (line.rfind("btime ", 0) == 0) boot = std::atoll(line.c_str() + 6);
  }
  const long ticks = sysconf(_SC_CLK_TCK);
  if (boot < 0 || ticks <= 0) return true;
  const long long started = boot + static_cast<long long>(start_ticks / static_cast<unsigned long long>(ticks));
  // btime and starttime are whole seconds and ticks: a second of slack
  // each way.
  return started <= static_cast<long long>(modified) + 2;
}

}  // namespace

int RemoveStaleSegments(const std::string& dir, long stale_after_s) {
  DIR* listing = opendir(dir.c_str());
  if (listing == nullptr) return 0;
  int removed = 0;
  const time_t now = std::time(nullptr);
  while (const dirent* entry = readdir(listing)) {
    const SegmentName name = ParseName(entry->d_name);
    if (name.creator < 0 || (name.deadline >= 0 && now < name.deadline + kDeadlineSlackS)) continue;
    struct stat st {};
    if (fstatat(dirfd(listing), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        now - st.st_mtime < stale_after_s) {
      continue;
    }
    if (CreatorAlive(name.creator, st.st_mtime)) continue;
    if (unlinkat(dirfd(listing), entry->d_name, 0) == 0) ++removed;
  }
  closedir(listing);
  return removed;
}

// Every rank reports its outcome in the store, rank 0 under the name key
// (the name, or kFailed and why), the others under mapped/<rank>, and every
// rank reads them in rank order and returns the first failure: the ranks
// take the same decision at once, where a rank that failed alone would
// leave the others waiting for it until the deadline.
StatusOr<std::unique_ptr<Segment>> Segment::CreateShared(store::Store& store,
                                                         const std::string& key_prefix,
                                                         int group_rank, int group_size,
                                                         size_t bytes, Deadline deadline) {
  const std::string name_key = key_prefix + "name";
  std::string name;
  std::string failure;  // why this rank has no mapping
  void* data = MAP_FAILED;
  if (group_rank == 0) {
    RemoveStaleSegments();
    std::random_device random;
    // A name that exists already (a segment left by a killed job whose
    // rank 0 had this pid: pids repeat across containers) is not this
    // group's to use: another number is drawn, a few times.
    constexpr int kNameTries = 8;
    int fd = -1;
    for (int attempt = 0; attempt < kNameTries && fd < 0; ++attempt) {
      name = "/ddp-" + std::to_string(getpid()) + "-" + std::to_string(random()) + "-" +
             std::to_string(WallClockSeconds(deadline));
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno != EEXIST) break;
    }
    const int open_error = errno;
    const std::string path = "/dev/shm" + name;
    if (fd < 0) {
      failure = "creating " + path + ": " + std::strerror(open_error);
      if (open_error == EEXIST) {
        failure += " (" + std::to_string(kNameTries) + " names tried, all taken)";
      }
    } else {
      // Reserved, not only sized: a tmpfs hands out pages at the first
      // touch, and one that has no room left (Docker gives a container a
      // /dev/shm of 64 MiB) raises SIGBUS there instead of failing here.
      int error = 0;
      do {
        error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // an error number, not -1
      } while (error == EINTR);
      if (error != 0) {
        failure = "reserving " + std::to_string(bytes) + " bytes for " + path + ": " +
                  std::strerror(error);
        if (error == ENOSPC) {
          failure += " (/dev/shm is too small: a container's is 64 MiB unless --shm-size says "
                     "otherwise; DDP_SHM_STAGING_BYTES sets each rank's share)";
        }
      } else {
        data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (data == MAP_FAILED) failure = Errno("mapping " + path);
      }
      close(fd);
      if (!failure.empty()) shm_unlink(name.c_str());
    }
    if (!failure.empty()) {
      const Status error = GroupFailure(0, failure);
      DDP_RETURN_IF_ERROR(store.Set(name_key, kFailed + error.message(), deadline));
      return error;
    }
    Status posted = store.Set(name_key, name, deadline);
    if (!posted.ok()) {
      munmap(data, bytes);
      shm_unlink(name.c_str());
      return posted;
    }
  } else {
    auto posted_name = store.Get(name_key, deadline);
    if (!posted_name.ok()) {
      return Status(posted_name.status().code(),
                    "shared-memory segment: waiting for local rank 0 to create it: " +
                        posted_name.status().message());
    }
    name = std::move(*posted_name);
    if (!name.empty() && name[0] == kFailed) return UnavailableError(name.substr(1));
    const std::string path = "/dev/shm" + name;
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    struct stat st {};
    if (fd < 0) {
      failure = Errno("opening " + path + " (local rank 0 created it)");
    } else if (fstat(fd, &st) != 0) {
      failure = Errno("fstat of " + path);
    } else if (static_cast<uint64_t>(st.st_size) < bytes) {
      // Mapping past its end would raise SIGBUS at the first touch there.
      failure = path + " holds " + std::to_string(st.st_size) + " bytes, this rank needs " +
                std::to_string(bytes);
    } else {
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) failure = Errno("mapping " + path);
    }
    if (fd >= 0) close(fd);
    const std::string outcome =
        failure.empty() ? "ok" : kFailed + GroupFailure(group_rank, failure).message();
    Status posted = store.Set(key_prefix + "mapped/" + std::to_string(group_rank), outcome,
                              deadline);
    if (!posted.ok()) {
      if (data != MAP_FAILED) munmap(data, bytes);
      return posted;
    }
  }
  std::unique_ptr<Segment> segment(data != MAP_FAILED ? new Segment(data, bytes) : nullptr);

  // Every rank tries to unlink the name, so that it goes even if rank 0
  // dies right after the last rank mapped it (ENOENT when another rank was
  // first: fine), and also when a rank failed.
  for (int rank = 1; rank < group_size; ++rank) {
    auto outcome = store.Get(key_prefix + "mapped/" + std::to_string(rank), deadline);
    if (!outcome.ok()) {
      shm_unlink(name.c_str());
      return Status(outcome.status().code(),
                    "shared-memory segment " + name + ": waiting for local rank " +
                        std::to_string(rank) + " to map it: " + outcome.status().message());
    }
    if (!outcome->empty() && (*outcome)[0] == kFailed) {
      shm_unlink(name.c_str());
      return UnavailableError(outcome->substr(1));
    }
  }
  shm_unlink(name.c_str());
  return segment;
}

Segment::~Segment() { munmap(data_, bytes_); }

}  // namespace ddp::transport::shm
