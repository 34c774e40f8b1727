#include "nn/io/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <zlib.h>

#include "nn/io/safetensors.h"

namespace ddp::nn::io {
namespace {

// internal::SetWritePausePerPiece's pause, in milliseconds.
std::atomic<int64_t> write_pause_per_piece_ms{0};
// internal::SetPauseBeforeRenameForTesting's pause, in milliseconds.
std::atomic<int64_t> pause_before_rename_ms{0};

// The tests' pauses wait on this, so that setting a pause to zero ends
// the pauses under way instead of leaving a test to wait them out.
std::mutex& PauseMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::condition_variable& PauseSettingChanged() {
  static auto* changed = new std::condition_variable;
  return *changed;
}
// Pauses begun so far (internal::PausesBegunForTesting); guarded by
// PauseMutex.
int64_t pauses_begun = 0;

// Waits `setting` milliseconds, or until the setting is turned to zero.
void PauseForTesting(const std::atomic<int64_t>& setting) {
  if (setting.load(std::memory_order_relaxed) <= 0) return;  // not under test: no lock
  std::unique_lock lock(PauseMutex());
  const int64_t ms = setting.load(std::memory_order_relaxed);
  if (ms <= 0) return;
  ++pauses_begun;
  PauseSettingChanged().wait_for(lock, std::chrono::milliseconds(ms),
                                 [&] { return setting.load(std::memory_order_relaxed) <= 0; });
}

// Stores a pause setting under PauseMutex (a pause about to wait sees it)
// and wakes the pauses under way, which end if it is zero.
void SetPause(std::atomic<int64_t>& setting, std::chrono::milliseconds pause) {
  {
    std::lock_guard lock(PauseMutex());
    setting.store(pause.count(), std::memory_order_relaxed);
  }
  PauseSettingChanged().notify_all();
}

// internal::SetTemporaryCreatedHookForTesting's hook.
std::function<void(const std::string&)>& TemporaryCreatedHook() {
  static auto* hook = new std::function<void(const std::string&)>;
  return *hook;
}

// Guards the two registries below. Held only for a lookup, never across a
// system call, so that a hung filesystem cannot block a stopper.
std::mutex& RegistryMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

// The flags of live OrderedStops, each with whether a writer watching it
// has passed its last stop check.
std::map<const std::atomic<bool>*, bool>& OrderedStops() {
  static auto* stops = new std::map<const std::atomic<bool>*, bool>;
  return *stops;
}

// Temporary files this process's writers have open or are creating
// (`<folder>/<name>`, as RemoveStaleTemporaries spells them), which its
// cleanup leaves alone without probing them: on NFS, flock is emulated
// with per-process fcntl locks, so a probe from this process would get a
// lock on its own writer's file, and its close would drop the writer's.
std::set<std::string>& OpenTemporaries() {
  static auto* open = new std::set<std::string>;
  return *open;
}

std::string Folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

[[noreturn]] void Fail(const std::string& path, const std::string& what, int err) {
  throw FileWriteError(path + ": " + what + ": " + std::strerror(err), err);
}

// Whether errno `err` from link(2) says the filesystem makes no hard links
// (vfat, some FUSE and network filesystems), rather than that it failed.
bool NoHardLinks(int err) { return err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS; }

// What a file of mode `mode` that is not a regular file is, for messages:
// "a folder", "a FIFO"...
std::string NonRegularKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  char octal[16];
  std::snprintf(octal, sizeof(octal), "%06o", static_cast<unsigned>(mode & S_IFMT));
  return std::string("a file of type ") + octal;
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// This host's name, as it goes into temporary file names: on a shared
// filesystem only the host that wrote a file can tell whether its writer
// lives (a pid means nothing elsewhere, nor in another container).
const std::string& HostTag() {
  static const std::string tag = [] {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return std::string("unknown");
    std::string t = name;
    for (char& c : t) {
      if (c == '/') c = '_';
    }
    return t;
  }();
  return tag;
}

// A random tag, fixed for the life of this process, that goes into its
// temporary file names after the counter: processes of different containers
// sharing a host name can have the same small pid, and their counters all
// start at 0, so pid and counter alone clash.
const std::string& ProcessNonce() {
  static const std::string nonce = [] {
    uint64_t v = 0;
    if (::getrandom(&v, sizeof(v), GRND_NONBLOCK) != static_cast<ssize_t>(sizeof(v))) {
      // No entropy yet (early boot) or no getrandom: time and pid still
      // differ between most processes, and a clash is retried anyway.
      v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
          (static_cast<uint64_t>(::getpid()) << 32);
    }
    // 32 bits, so that the name stays short (a long checkpoint name plus
    // the host tag must still fit NAME_MAX); a clash is retried anyway.
    char buf[9];
    std::snprintf(buf, sizeof(buf), "%08llx", static_cast<unsigned long long>((v ^ (v >> 32)) & 0xffffffffull));
    return std::string(buf);
  }();
  return nonce;
}

constexpr size_t kNameMax = 255;
// Bytes of a long file name kept in its temporaries' names.
constexpr size_t kKeptOfLongName = 100;
// The longest host name Linux gives (HOST_NAME_MAX).
constexpr size_t kHostNameMax = 64;

// `<first 100 bytes of base>.<crc>.tmp.`: the start of the temporaries'
// names of a file whose name is too long to take their suffix, the CRC-32
// of the whole name standing for the part cut off. `base` is longer than
// kKeptOfLongName.
std::string ShortenedPrefix(const std::string& base) {
  size_t cut = kKeptOfLongName;
  // Not inside a UTF-8 sequence: back up over its continuation bytes.
  while (cut > 0 && (static_cast<unsigned char>(base[cut]) & 0xC0) == 0x80) --cut;
  const uLong crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(base.data()),
                          static_cast<uInt>(base.size()));
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08lx", static_cast<unsigned long>(crc & 0xffffffffu));
  return base.substr(0, cut) + "." + hex + ".tmp.";
}

// The start of the names of `path`'s temporary files: `<name>.tmp.`, or
// ShortenedPrefix for a name so long that the rest (pid, counter, nonce
// and host) could take the whole over NAME_MAX, 255 bytes; the creation of
// the temporary file would fail otherwise, though the target's own name is
// legal. The rest is counted with the longest host name, not this host's,
// so that every writer of `path`, on any host sharing the folder, uses the
// same prefix, and the cleanup finds the temporaries their killed writers
// left: counted with this host's name, a 149-byte name was cut on a host
// with a 64-byte name and kept whole on one with a short name, whose
// cleanup then never looked at the other's.
std::string TemporaryPrefix(const std::string& path) {
  const std::string base = BaseName(path);
  // ".tmp." + pid (7 digits at most) + "." + counter (20 at most) + "-" +
  // nonce (8) + "." + host (a name longer than Linux gives counted as it is).
  const size_t rest = 5 + 7 + 1 + 20 + 1 + 8 + 1 + std::max(kHostNameMax, HostTag().size());
  if (base.size() + rest <= kNameMax) return base + ".tmp.";
  return ShortenedPrefix(base);
}

// Whether `text` is a run of lowercase hexadecimal digits.
bool AllHex(const std::string& text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Whether `text` is a run of decimal digits.
bool AllDigits(const std::string& text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// Whether flock's errno `err` says the filesystem has no such locks (NFS
// without lock support, some FUSE filesystems; NFS also refuses an
// exclusive lock on a read-only descriptor with EBADF).
bool NoLocks(int err) {
  return err == ENOLCK || err == ENOSYS || err == EINVAL || err == EBADF || err == ENOTSUP || err == EOPNOTSUPP;
}

// How long another host's temporary must have gone unchanged, besides
// unlocked, before its writer is taken for dead (RemoveStaleTemporaries).
// Writers write their pieces back to back (every caller here does), each
// piece moving the mtime, so the file of a live writer that is not stopped
// changes far more often than that, even on a slow disk.
constexpr std::chrono::hours kForeignTemporaryIdle{1};

// Removes `file` unless a writer holds its lock (the writer takes it as it
// creates the file, and the kernel drops it when the writer dies). Locks
// belong to the open file description, so a writer thread of this process
// conflicts with this probe as another process's would. The unlink happens
// while the probe holds the lock: a writer that locks its new file after
// that finds it gone (AtomicFileWriter's constructor) and starts another.
// Where the filesystem has no locks, `pid_gone` decides. With `idle_too`
// (another host's temporary), a file also stays unless its mtime is
// kForeignTemporaryIdle old. A file that cannot be opened, or whose lock
// fails otherwise, is left alone.
void RemoveUnlessLocked(const std::string& file, bool pid_gone, bool idle_too) {
  // A writer makes only regular files: a FIFO or a device of that name is
  // someone else's, and is not even opened (opening a device may act on it).
  struct stat st{};
  if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  // Read-write: NFS refuses an exclusive lock on a read-only descriptor.
  // A file this user may only read is probed read-only.
  int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == EACCES) fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return;
  // The name may lead to another file by now than the lstat saw.
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return;
  }
  bool gone = ::flock(fd, LOCK_EX | LOCK_NB) == 0 || (NoLocks(errno) && pid_gone);
  if (gone && idle_too) {
    // Looked at under the lock, so that the window for a write unseen is
    // as short as it can be.
    timespec now{};
    gone = ::fstat(fd, &st) == 0 && ::clock_gettime(CLOCK_REALTIME, &now) == 0 &&
           now.tv_sec - st.st_mtim.tv_sec >= std::chrono::seconds(kForeignTemporaryIdle).count();
  }
  if (gone) ::unlink(file.c_str());
  ::close(fd);  // EWOULDBLOCK: a writer lives
}

// Removes `<name>.tmp.<pid>.<n>-<nonce>.<host>` files (`<name>.tmp.` or
// the shortened form TemporaryPrefix gives) that writers left when they were killed
// (SIGKILL leaves no chance to clean up): each could be as large as a whole
// checkpoint. Only names of exactly that form, as the constructor makes
// them (the nonce lowercase hex digits), are taken for temporaries: a
// user's own `<name>.tmp.1.2` or `<name>.tmp.1.2.<host>` (a copy kept by
// hand, another tool's temporary) is not this code's and stays, as do
// files of other targets (`<name>.tmp.5`'s own temporaries). The lock each
// writer holds on its file decides, not the pid: in containers a restarted
// job gets the same small pids and host name, so a dead writer's pid may be
// this process's or a live stranger's, and a live writer's pid may name no
// process here (another PID namespace). Only where the filesystem has no
// locks does the pid decide (one that names no process here).
//
// Another host's temporaries (a container restarted under a new host name
// leaves its old name on those its killed writers left in a persistent
// folder) go only when unlocked and also unchanged for
// kForeignTemporaryIdle. On one kernel (a local disk, whatever the
// container's name) the lock alone would tell, but across hosts it may
// not: NFS mounted with nolock or local_lock=flock, or Lustre with
// localflock, grants every host its own flock locks without an error, so a
// live writer elsewhere looks unlocked here. Its mtime still moves with each
// piece it writes. Should even that mislead (a writer stopped for an hour
// between pieces, or this host's clock an hour ahead of the file server's),
// the writer's Commit fails (its fsync or its rename finds the file gone)
// and its target stays as it was: a failed save, never a mixed file.
// Without locks at all, another host's pid says nothing, and its
// temporaries stay. This process's own open temporaries are not probed at
// all.
void RemoveStaleTemporaries(const std::string& path) {
  const std::string folder = Folder(path);
  // Both forms, whichever TemporaryPrefix gives now: writers built before
  // it ignored the host's name length cut a name near the limit on one
  // host and kept it whole on another.
  const std::string base = BaseName(path);
  std::vector<std::string> prefixes = {base + ".tmp."};
  if (base.size() > kKeptOfLongName) prefixes.push_back(ShortenedPrefix(base));
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return;  // the create below reports the real problem
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    const auto prefix = std::find_if(prefixes.begin(), prefixes.end(), [&name](const std::string& p) {
      return name.compare(0, p.size(), p) == 0;
    });
    if (prefix == prefixes.end()) continue;
    const std::string rest = name.substr(prefix->size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos) continue;
    const std::string pid_text = rest.substr(0, dot);
    const size_t dot2 = rest.find('.', dot + 1);
    if (dot2 == std::string::npos) continue;
    // `<n>-<nonce>`: the nonce as ProcessNonce spells it.
    std::string counter = rest.substr(dot + 1, dot2 - dot - 1);
    const size_t dash = counter.find('-');
    if (dash == std::string::npos) continue;
    const std::string nonce = counter.substr(dash + 1);
    counter.resize(dash);
    const std::string host = rest.substr(dot2 + 1);
    // 8 digits, or 16 from writers built before the nonce was shortened.
    if (!AllDigits(pid_text) || !AllDigits(counter) || (nonce.size() != 8 && nonce.size() != 16) ||
        !AllHex(nonce) || host.empty() || pid_text.size() > 9) {
      continue;
    }
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0) continue;
    const std::string file = folder + "/" + name;
    {
      std::lock_guard lock(RegistryMutex());
      if (OpenTemporaries().count(file) != 0) continue;
    }
    const bool here = host == HostTag();
    RemoveUnlessLocked(file,
                       here && pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH,
                       /*idle_too=*/!here);
  }
  ::closedir(dir);
}

}  // namespace

// The file a write to `path` should replace: `path` itself, or, when its
// last component is a symbolic link, the file the link leads to (following
// links to links), so that the link stays and its target gets the new
// contents, as a plain open-and-write (torch.save) would give. Links in the
// folders above need nothing: the rename works through them. A dangling
// link names the file to create; its folder must exist. Throws naming the
// link and where it leads for a loop, a chain longer than the kernel
// follows, or a target whose folder is missing.
bool IsStreamPath(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return false;
  if (S_ISFIFO(st.st_mode)) return true;
  if (!S_ISCHR(st.st_mode)) return false;
  // A terminal, by its device number. Linux's tty majors: 4 (virtual
  // consoles, serial ports), 5 (/dev/tty, /dev/console), 136-143
  // (pseudo-terminals, /dev/pts/N).
  const unsigned major_number = major(st.st_rdev);
  return major_number == 4 || major_number == 5 || (major_number >= 136 && major_number <= 143);
}

std::string AtomicWriteTarget(const std::string& path) {
  // The kernel's own limit on links followed in one lookup (MAXSYMLINKS).
  constexpr int kMostLinks = 40;
  std::string current = path;
  for (int links = 0;; ++links) {
    struct stat st{};
    if (::lstat(current.c_str(), &st) != 0) {
      const int err = errno;
      if (err != ENOENT || current == path) return current;  // the create reports other problems
      // A dangling link: its target will be created, in a folder that must exist.
      struct stat folder{};
      if (::stat(Folder(current).c_str(), &folder) != 0 || !S_ISDIR(folder.st_mode)) {
        throw CheckpointError("cannot write a file at '" + path + "': it is a symbolic link to '" + current +
                              "', whose folder '" + Folder(current) + "' does not exist");
      }
      return current;
    }
    if (!S_ISLNK(st.st_mode)) return current;
    if (links == kMostLinks) {
      throw CheckpointError("cannot write a file at '" + path + "': more than " + std::to_string(kMostLinks) +
                            " symbolic links in a row (a loop?), the last one '" + current + "'");
    }
    // PATH_MAX: the kernel follows no longer link.
    std::string target(4096, '\0');
    const ssize_t n = ::readlink(current.c_str(), target.data(), target.size());
    if (n < 0) {
      const int err = errno;
      Fail(current, "cannot read the symbolic link", err);
    }
    if (static_cast<size_t>(n) == target.size()) {
      throw CheckpointError("cannot write a file at '" + path + "': the symbolic link '" + current +
                            "' leads to a path of 4096 bytes or more");
    }
    target.resize(static_cast<size_t>(n));
    if (target.empty()) {
      throw CheckpointError("cannot write a file at '" + path + "': the symbolic link '" + current +
                            "' is empty");
    }
    // A relative target is relative to the link's folder.
    current = target.front() == '/' ? target : Folder(current) + "/" + target;
  }
}

namespace internal {
void SetWritePausePerPiece(std::chrono::milliseconds pause) { SetPause(write_pause_per_piece_ms, pause); }
void SetPauseBeforeRenameForTesting(std::chrono::milliseconds pause) { SetPause(pause_before_rename_ms, pause); }
int64_t PausesBegunForTesting() {
  std::lock_guard lock(PauseMutex());
  return pauses_begun;
}
void SetTemporaryCreatedHookForTesting(std::function<void(const std::string&)> hook) {
  TemporaryCreatedHook() = std::move(hook);
}
}  // namespace internal

std::string AtomicFileWriter::Named() const {
  return asked_ == path_ ? path_ : asked_ + " (a symbolic link to " + path_ + ")";
}

void AtomicFileWriter::FailOnTemporary(const std::string& what, int err) const {
  throw FileWriteError(Named() + ": " + what + ": " + std::strerror(err) + " (temporary file " + temp_path_ + ")",
                       err);
}

AtomicFileWriter::AtomicFileWriter(std::string path, const std::atomic<bool>* stop)
    : asked_(path), path_(std::move(path)), stop_(stop) {
  static std::atomic<uint64_t> counter{0};
  if (path_.empty() || path_.back() == '/') {
    throw CheckpointError("cannot write a file at '" + path_ + "': not a file name");
  }
  // Renaming over a symbolic link would put a regular file in its place and
  // leave the file it leads to with the old contents.
  const std::string asked = path_;
  if (std::string target = AtomicWriteTarget(path_); target != path_) {
    if (target.back() == '/') {
      throw CheckpointError("cannot write a file at '" + path_ + "': it is a symbolic link to '" + target +
                            "', not a file name");
    }
    path_ = std::move(target);
  }
  // Before anything is written. Only a regular file may be replaced: the
  // rename would fail over a folder (EISDIR) only after the whole file was
  // written, and would silently put a regular file in the place of a FIFO,
  // a socket or a device (a checkpoint saved to /dev/null replaced the
  // system's /dev/null).
  struct stat target{};
  const bool exists = ::stat(path_.c_str(), &target) == 0;
  if (exists && !S_ISREG(target.st_mode)) {
    const std::string what = NonRegularKind(target.st_mode);
    throw CheckpointError(
        asked == path_ ? "cannot write a file at '" + path_ + "': it is " + what +
                             ", not a regular file; it was left as it is"
                       : "cannot write a file at '" + asked + "': it is a symbolic link to '" + path_ +
                             "', which is " + what + ", not a regular file; both were left as they are");
  }
  // A file replaced keeps its permissions (a private checkpoint stays
  // private), as an editor's save would. The temporary is created with
  // them already, not widened and then narrowed: a reader who opened it in
  // between would keep reading all that is written to it.
  const bool replaces = exists;
  const mode_t create_mode = replaces ? (target.st_mode & 0777) : 0644;
  RemoveStaleTemporaries(path_);
  // Held until the descriptor closes: another writer's cleanup (this
  // process's, another's, another PID namespace's) sees that this writer
  // lives. A cleanup that probed the file between its creation and this
  // lock removed it, holding the lock as it did: then the name no longer
  // leads to this file, and another is made. A filesystem without locks
  // only loses that protection.
  // A name already taken (a writer of another process that drew the same
  // pid, counter and nonce, or a file left by anything else) is passed
  // over for the next one.
  constexpr int kMostClashes = 100;
  int clashes = 0;
  for (int attempt = 0;; ++attempt) {
    temp_path_ = path_.substr(0, path_.size() - BaseName(path_).size()) + TemporaryPrefix(path_) +
                 std::to_string(::getpid()) + "." + std::to_string(counter++) + "-" + ProcessNonce() + "." +
                 HostTag();
    const std::string entry = Folder(path_) + "/" + BaseName(temp_path_);
    auto forget = [&entry] {
      std::lock_guard lock(RegistryMutex());
      OpenTemporaries().erase(entry);
    };
    {
      std::lock_guard lock(RegistryMutex());
      OpenTemporaries().insert(entry);
    }
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, create_mode);
    if (fd_ < 0) {
      const int err = errno;  // before any string is built
      forget();
      if (err == EEXIST && ++clashes < kMostClashes) {
        --attempt;  // a clash is not a cleanup's removal
        continue;
      }
      FailOnTemporary("cannot create temporary file" +
                          (err == EEXIST ? " (" + std::to_string(clashes) + " names tried, all taken)"
                                         : std::string()),
                      err);
    }
    if (const auto& hook = TemporaryCreatedHook(); hook) hook(temp_path_);
    const bool locked = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
    if (!locked && errno != EWOULDBLOCK) break;  // no locks here
    struct stat mine{}, named{};
    if (locked && ::fstat(fd_, &mine) == 0 && ::stat(temp_path_.c_str(), &named) == 0 &&
        mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
      break;
    }
    // Held by a cleanup (which removes it), or removed by one.
    ::close(fd_);
    fd_ = -1;
    forget();
    if (attempt == 9) {
      throw CheckpointError(Named() + ": cannot create temporary file: other writers' cleanups removed it " +
                            std::to_string(attempt + 1) + " times (last " + temp_path_ + ")");
    }
  }
  // The umask may have narrowed the mode at creation. Only the permission
  // bits are carried over: a setuid, setgid or sticky bit of the old file
  // is not given to new contents written by this process.
  if (replaces && ::fchmod(fd_, create_mode) != 0) {
    const int err = errno;
    struct stat now{};
    // A filesystem without modes (its files all show one fixed mode) may
    // refuse; what matters is whether the file ended with the old mode.
    if (::fstat(fd_, &now) != 0 || (now.st_mode & 0777) != create_mode) {
      char wanted[8];
      std::snprintf(wanted, sizeof(wanted), "%04o", static_cast<unsigned>(create_mode));
      // The destructor does not run for a constructor that throws.
      ::close(fd_);
      fd_ = -1;
      ::unlink(temp_path_.c_str());
      {
        std::lock_guard lock(RegistryMutex());
        OpenTemporaries().erase(Folder(path_) + "/" + BaseName(temp_path_));
      }
      FailOnTemporary(std::string("cannot give the temporary file the replaced file's permissions ") + wanted, err);
    }
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
  std::lock_guard lock(RegistryMutex());
  OpenTemporaries().erase(Folder(path_) + "/" + BaseName(temp_path_));
}

void AtomicFileWriter::CheckStop() const {
  if (stop_ != nullptr && stop_->load(std::memory_order_relaxed)) {
    throw CheckpointError(Named() + ": the write was stopped before it ended; the file was left as it was");
  }
}

// A Write or Commit after one that threw: the temporary file may be short
// (a short write before ENOSPC, a stop between pieces) or its data not on
// disk (a failed fsync reports its error once; a second one may succeed
// without the lost pages), so it must not be renamed into place.
void AtomicFileWriter::CheckNotFailed() const {
  if (failed_) {
    CheckStop();  // a stop explains it best
    throw CheckpointError(Named() + ": an earlier write or commit of " + temp_path_ +
                          " failed, so it cannot be committed; the file was left as it was");
  }
}

void AtomicFileWriter::Write(const void* data, size_t nbytes) {
  CheckNotFailed();
  if (committed_ || fd_ < 0) throw CheckpointError(path_ + ": write after commit");
  failed_ = true;  // until every byte is written
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    // Before the stop check, so that a stop asked for during the pause
    // spares the piece, as it would a piece not yet begun on a slow disk.
    PauseForTesting(write_pause_per_piece_ms);
    CheckStop();
    const ssize_t n = ::write(fd_, p, std::min(nbytes, kStopCheckBytes));
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      FailOnTemporary("write failed", err);
    }
    // Some FUSE filesystems answer 0 instead of an error: asking again
    // would loop forever.
    if (n == 0) FailOnTemporary("write failed: it wrote nothing", EIO);
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  failed_ = false;
}

void AtomicFileWriter::Commit() { (void)Place(/*replace=*/true); }

bool AtomicFileWriter::CommitUnlessPresent() { return Place(/*replace=*/false); }

bool AtomicFileWriter::Place(bool replace) {
  CheckNotFailed();
  if (committed_ || fd_ < 0) throw CheckpointError(path_ + ": committed twice");
  failed_ = true;  // until the rename
  CheckStop();
  // The data must be on disk before the rename makes it visible under the
  // final name, or a crash could expose a renamed but empty file.
  if (::fsync(fd_) != 0) {
    const int err = errno;
    FailOnTemporary("fsync failed", err);
  }
  const int fd = fd_;
  fd_ = -1;
  // A second handle on the open file keeps its lock (the writer lives)
  // until the rename is done; close's own checks still run on the first
  // (a flush on close happens at every close).
  struct LockKeeper {
    int fd;
    ~LockKeeper() {
      if (fd >= 0) ::close(fd);
    }
  } lock_keeper{::fcntl(fd, F_DUPFD_CLOEXEC, 0)};
  if (::close(fd) != 0) {
    const int err = errno;
    FailOnTemporary("close failed", err);
  }
  // The constructor refused a target that was not a regular file, but a
  // long write leaves time for something to take its place: a FIFO, a
  // device or a link the rename would silently replace. Looked at again
  // here, with lstat, as the rename sees the name (the constructor resolved
  // any links, so a link now was put there since). Before the stop check
  // below, so that a writer marked past its last check does rename. A
  // replacement after this look still wins: rename has no "only over a
  // regular file" form.
  struct stat now{};
  if (::lstat(path_.c_str(), &now) == 0 && !S_ISREG(now.st_mode)) {
    ::unlink(temp_path_.c_str());
    throw CheckpointError("cannot write a file at '" + path_ + "': it is " + NonRegularKind(now.st_mode) +
                          " now (put there while the new contents were written), not a regular file; it was "
                          "left as it is, and the new contents were not saved");
  }
  // Most of the disk work happens in fsync: a caller whose deadline passed
  // meanwhile may have told every rank that the save failed, so the new
  // file must not appear under the final name after all. Under the
  // registry's lock, so that an OrderedStop::Stop is either seen here or
  // learns that this writer is past its last check.
  bool stopped = false;
  {
    std::lock_guard lock(RegistryMutex());
    stopped = stop_ != nullptr && stop_->load(std::memory_order_relaxed);
    if (!stopped && stop_ != nullptr) {
      if (auto it = OrderedStops().find(stop_); it != OrderedStops().end()) it->second = true;
    }
  }
  if (stopped) {
    ::unlink(temp_path_.c_str());
    throw CheckpointError(Named() + ": the write was stopped before it ended; the file was left as it was");
  }
  PauseForTesting(pause_before_rename_ms);
  if (replace) {
    if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
      const int err = errno;  // building the message may change errno
      FailOnTemporary("cannot rename the temporary file to it", err);
    }
  } else if (::link(temp_path_.c_str(), path_.c_str()) == 0) {
    ::unlink(temp_path_.c_str());  // the new file stays, under the target's name
  } else {
    const int err = errno;
    struct stat linked{};
    if (err == EEXIST && ::fstat(lock_keeper.fd, &linked) == 0 && linked.st_nlink >= 2) {
      // The link was made, but its reply was lost and the retried call
      // found the name taken (NFS): the temporary has the target's name too.
      ::unlink(temp_path_.c_str());
    } else if (err == EEXIST || (NoHardLinks(err) && ::lstat(path_.c_str(), &now) == 0)) {
      ::unlink(temp_path_.c_str());
      failed_ = false;  // nothing went wrong, and nothing is left to commit (fd_ is closed)
      return false;
    } else if (NoHardLinks(err)) {
      // Only a rename puts the file in place here: a file put at the target
      // between the look above and the rename is replaced after all.
      if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
        const int rename_err = errno;
        FailOnTemporary("cannot rename the temporary file to it", rename_err);
      }
    } else {
      FailOnTemporary("cannot link the temporary file to it", err);
    }
  }
  committed_ = true;
  failed_ = false;
  // The rename itself lives in the folder's entry table. Failing here, the
  // new file is already in place (readers see it); only its surviving a
  // crash is in doubt, which the error must say rather than "not saved".
  try {
    SyncFolder(Folder(path_));
  } catch (const FileWriteError& e) {
    throw FileWriteError(Named() + ": written and renamed into place, but it may not survive a crash: " + e.what(),
                         e.error_number(), /*in_place=*/true);
  }
  return true;
}

OrderedStop::OrderedStop(std::atomic<bool>& stop) : stop_(stop) {
  std::lock_guard lock(RegistryMutex());
  OrderedStops()[&stop_] = false;
}

OrderedStop::~OrderedStop() {
  std::lock_guard lock(RegistryMutex());
  OrderedStops().erase(&stop_);
}

bool OrderedStop::Stop() {
  std::lock_guard lock(RegistryMutex());
  stop_.store(true, std::memory_order_relaxed);
  return OrderedStops()[&stop_];
}

void SyncFolder(const std::string& folder) {
  const int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) {
    const int err = errno;
    Fail(folder, "cannot open folder to fsync it", err);
  }
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0 && !internal::FolderFsyncUnsupported(err)) Fail(folder, "fsync of folder failed", err);
}

namespace internal {

bool FolderFsyncUnsupported(int err) {
  // fsync(2): EINVAL or EROFS for a file that does not support
  // synchronization; some FUSE and network filesystems answer a folder's
  // with ENOTSUP or EBADF instead. The entry is in place either
  // way; the filesystem makes no promise to keep it.
  return err == EINVAL || err == ENOTSUP || err == EOPNOTSUPP || err == EBADF || err == EROFS;
}

}  // namespace internal

}  // namespace ddp::nn::io
