#include "nn/data/decoded_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cctype>
#include <climits>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "nn/io/atomic_file.h"
#include "nn/io/safetensors.h"

namespace ddp::nn::data::internal {
namespace {

// Version 3 added the change time to SourceStat, version 4 took the
// device number out.
constexpr char kMagic[8] = {'D', 'D', 'P', 'D', 'E', 'C', '4', '\0'};
constexpr uint32_t kMaxDims = 8;
constexpr uint32_t kMaxSources = 64;

// An entry: this header, the stat of each source file, the dimensions (u64
// each), then the data.
struct Header {
  char magic[8];
  uint64_t data_bytes;
  uint32_t ndims;
  uint32_t nsources;
  uint32_t crc;
  uint32_t reserved;
};

// What identifies a source file's contents without reading it. The change
// time is there because the modification time can be set back (`cp -p` or
// `touch -r` onto the file), the change time cannot. The device number is
// not: an overlay (a container's root) or an NFS mount gets another one
// each time it is mounted, for the same files with the same inodes and
// times, so every restart of a container decoded its sets again and wrote
// new entries. Another file at the same path with the same inode, size
// and both times is all but impossible without the device (its change
// time is when it was made or last changed).
struct SourceStat {
  uint64_t ino;
  uint64_t size;
  int64_t mtime_ns;
  int64_t ctime_ns;
  bool operator==(const SourceStat&) const = default;
};

// Set once a failed write has been reported: a cache that cannot be
// written fails the same way for every set and rank, and one line says it.
std::atomic<bool> write_failure_reported{false};
std::atomic<bool> limit_below_use_reported{false};
std::atomic<bool> lock_failure_reported{false};
std::atomic<bool> sync_failure_reported{false};

// The entries this process wrote or loaded (full paths): eviction leaves
// them. Evicting one (a run whose training and test sets together exceed
// the limit, each write evicting the other) only made the next load decode
// and write it again, every run, so the cache cost more than none.
struct EntriesInUse {
  std::mutex mu;
  std::set<std::string> paths;
};
EntriesInUse& InUse() {
  static EntriesInUse* in_use = new EntriesInUse;  // never destroyed: loads may run at exit
  return *in_use;
}
void NoteInUse(const std::string& path) {
  std::lock_guard<std::mutex> l(InUse().mu);
  InUse().paths.insert(path);
}

// Set by a process that said a warning for its job, to the cache folder,
// for the ranks it starts after (SaysForTheJob): one variable per kind of
// warning, so that a launcher that said the cache cannot be written leaves
// its ranks free to say that it cannot be locked.
constexpr char kWriteReportedEnv[] = "DDP_DATA_CACHE_REPORTED";
constexpr char kLockReportedEnv[] = "DDP_DATA_CACHE_LOCK_REPORTED";
constexpr const char* kReportedEnvs[] = {kWriteReportedEnv, kLockReportedEnv};

// This process's rank among its node's ranks, as launchers give it (null
// when it runs under none).
const char* LocalRank() {
  for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    if (const char* v = std::getenv(name); v != nullptr && v[0] != '\0') return v;
  }
  return nullptr;
}

// The kReportedEnvs, made empty before main in a process under no
// launcher (one that may start ranks), so that SaysForTheJob only ever
// replaces a value: glibc replaces a variable's value in place, safe beside
// a getenv in another thread (the launcher's signal thread, a library's
// pool), but adding one reallocates the environment's array and frees the
// old one under it.
const bool reported_env_made = [] {
  for (const char* name : kReportedEnvs) {
    if (LocalRank() == nullptr && std::getenv(name) == nullptr) ::setenv(name, "", 0);
  }
  return true;
}();

// Whether this process says a warning about the cache folder `dir` that
// every process of a job meets alike (that the folder cannot be written,
// or locked): a trainer that launches its own ranks loads the sets first
// (to check them), so the line came once from the launcher and once from
// each rank. A rank says it only as its node's first (local rank 0: ddprun
// and torchrun load nothing themselves) and only when the process that
// started it has not (`reported_env`, the warning's kind's variable,
// names `dir`). A process under no launcher that says it puts `dir` in
// `reported_env` for the ranks it starts after.
bool SaysForTheJob(const char* reported_env, const std::string& dir) {
  const char* reported = std::getenv(reported_env);
  if (reported != nullptr && dir == reported) return false;
  const char* local_rank = LocalRank();
  if (local_rank != nullptr) return std::string_view(local_rank) == "0";
  if (reported_env_made && reported != nullptr) ::setenv(reported_env, dir.c_str(), 1);  // in place only
  return true;
}

// An entry that could not be written: loads go on decoding in memory, but
// each one pays the decode again, so the job says once where and why
// (SaysForTheJob).
void ReportWriteFailure(const std::string& path, const std::string& cause) {
  if (write_failure_reported.exchange(true)) return;
  if (!SaysForTheJob(kWriteReportedEnv, DecodedCacheDir())) return;
  std::fprintf(stderr,
               "[ddp] warning: decoded dataset cache: cannot write %s: %s; datasets are decoded in memory "
               "on every load (DDP_DATA_CACHE=<folder> moves the cache, DDP_DATA_CACHE=off turns it off)\n",
               path.c_str(), cause.c_str());
}

// An entry written and in place whose folder could not be fsynced: said
// once, apart from the failures to write, since the entry is used. Said by
// each process that meets it, not once per job (SaysForTheJob): only the
// process that wrote an entry meets it (the others map that entry), and
// that is any rank, so a line left to local rank 0 would often be said by
// no one. Where the filesystem has locks, one process writes each set.
void ReportSyncFailure(const std::string& cause) {
  if (sync_failure_reported.exchange(true)) return;
  std::fprintf(stderr,
               "[ddp] warning: decoded dataset cache: %s; the entry is used, and written again if a crash loses "
               "it\n",
               cause.c_str());
}

uint32_t Crc(const uint8_t* data, size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths.
  for (size_t done = 0; done < n;) {
    const uInt piece = static_cast<uInt>(std::min<size_t>(n - done, size_t{1} << 30));
    crc = crc32(crc, data + done, piece);
    done += piece;
  }
  return static_cast<uint32_t>(crc);
}

// The first source's file name and an FNV-1a hash of every source's
// absolute path and identity (SourceStat): the entry's file name. An entry
// is valid only for the source files it was decoded from, so hosts sharing
// a cache folder (a home directory on NFS) whose copies of a set differ
// (another inode or change time) get an entry each, instead of
// replacing each other's at every load under ranks that have it mapped;
// hosts that see the same files (same identity) share one. The name used
// to hash the host name for that: a container whose host name changes at
// each restart then missed its own entries on a persistent volume. A
// source that changes gets a new name; its old entry is never read again
// and goes with the least recently used (EvictLeastRecentlyUsed).
std::string EntryName(const std::vector<std::string>& sources, const std::vector<SourceStat>& stats) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((v >> (8 * byte)) & 0xff)) * 1099511628211ull;
  };
  std::string first;
  for (const std::string& source : sources) {
    char* real = ::realpath(source.c_str(), nullptr);
    const std::string path = real != nullptr ? real : source;
    std::free(real);
    if (first.empty()) first = path;
    for (unsigned char c : path) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // a separator between paths
  }
  for (const SourceStat& st : stats) {
    mix(st.ino);
    mix(st.size);
    mix(static_cast<uint64_t>(st.mtime_ns));
    mix(static_cast<uint64_t>(st.ctime_ns));
  }
  const size_t slash = first.find_last_of('/');
  std::string base = slash == std::string::npos ? first : first.substr(slash + 1);
  for (char& c : base) {
    if (c == '.' || c == '-' || c == '_') continue;
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return base + "-" + hex + ".decoded";
}

// The sources' stats; false when one is not a regular file.
bool StatSources(const std::vector<std::string>& sources, std::vector<SourceStat>* out) {
  for (const std::string& source : sources) {
    struct stat st;
    if (::stat(source.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
    out->push_back({static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
                    static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                    static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec});
  }
  return !out->empty() && out->size() <= kMaxSources;
}

// Reads `n` bytes at `offset` of `fd`; false when the file has fewer.
bool ReadAt(int fd, void* dst, size_t n, off_t offset) {
  for (size_t got = 0; got < n;) {
    const ssize_t r = ::pread(fd, static_cast<char*>(dst) + got, n - got, offset + static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

// Set by tests: called with the entry's path after it is mapped, before
// its data's CRC is checked.
std::function<void(const std::string&)> before_mapping_check_hook;

// Whether the `n` bytes at `offset` of `fd` have the CRC `crc`; false also
// when the file has fewer (cut short since it was measured). Read with
// pread, not through the entry's mapping: a read of the mapping past a cut
// raises SIGBUS, and the load would kill the process (a job's every rank,
// loading the set at once) instead of decoding the set again. The copy
// through a 1 MiB buffer costs some: mapping and checking 47 MB (the size
// of Fashion-MNIST's training images) took 63-114 ms this way against
// 44-72 ms through the mapping, five runs each on the shared 2-core VM
// under load (2026-12-08), once per load, against ~0.3 s to decode.
bool DataHasCrc(int fd, off_t offset, uint64_t n, uint32_t crc) {
  std::vector<uint8_t> buffer(std::min<uint64_t>(n, uint64_t{1} << 20));
  uLong got = crc32(0L, Z_NULL, 0);
  for (uint64_t done = 0; done < n;) {
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(n - done, buffer.size()));
    if (!ReadAt(fd, buffer.data(), piece, offset + static_cast<off_t>(done))) return false;
    got = crc32(got, buffer.data(), static_cast<uInt>(piece));
    done += piece;
  }
  return static_cast<uint32_t>(got) == crc;
}

// Which file a name led to (its device and inode), to tell later whether
// the name still leads to it.
struct FileId {
  bool found = false;
  dev_t dev = 0;
  ino_t ino = 0;
};

// The entry at `path` when it is whole and describes `sources`; else an
// empty array, with the file that was there and was refused in `*refused`
// (when given; `found` false when no file could be opened). The header,
// source stats and dimensions are read and checked before the file is
// mapped: the mapping reads it whole (MAP_POPULATE), which a file of
// another kind at the entry's name, or an entry of sources that changed
// since, would cost for nothing.
SharedArray MapEntry(const std::string& path, const std::vector<SourceStat>& sources, FileId* refused = nullptr) {
  if (refused != nullptr) *refused = FileId{};
  // O_NONBLOCK: a FIFO at the entry's name would otherwise hold the open
  // until some process writes to it; here it is refused as not a regular
  // file. The flag changes nothing for the reads and the mapping of one.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return {};
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return {};
  // Taken back below when the file is a whole entry.
  if (refused != nullptr) *refused = FileId{true, st.st_dev, st.st_ino};
  if (!S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) < sizeof(Header)) return {};
  const size_t bytes = static_cast<size_t>(st.st_size);
  Header h;
  if (!ReadAt(fd, &h, sizeof(h), 0) || std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.ndims == 0 ||
      h.ndims > kMaxDims || h.nsources != sources.size()) {
    return {};
  }
  const size_t header_bytes = sizeof(Header) + sizeof(SourceStat) * h.nsources + 8 * h.ndims;
  if (bytes < header_bytes || bytes - header_bytes != h.data_bytes) return {};
  std::vector<char> head(header_bytes);
  if (!ReadAt(fd, head.data(), header_bytes, 0)) return {};
  for (uint32_t i = 0; i < h.nsources; ++i) {
    SourceStat recorded;
    std::memcpy(&recorded, head.data() + sizeof(Header) + sizeof(SourceStat) * i, sizeof(recorded));
    if (!(recorded == sources[i])) return {};
  }
  SharedArray out;
  uint64_t count = 1;
  for (uint32_t d = 0; d < h.ndims; ++d) {
    uint64_t dim;
    std::memcpy(&dim, head.data() + sizeof(Header) + sizeof(SourceStat) * h.nsources + 8 * d, sizeof(dim));
    if (dim > static_cast<uint64_t>(INT64_MAX) || (dim != 0 && count > UINT64_MAX / dim)) return {};
    count *= dim;
    out.dims.push_back(static_cast<int64_t>(dim));
  }
  if (count != h.data_bytes) return {};
  // A shared lock on the entry, held while it is mapped: eviction in any
  // process (EvictLeastRecentlyUsed) leaves an entry locked so. Unlinked
  // under this mapping by another host sharing the folder over NFS, its
  // pages would be lost (an NFS client keeps an unlinked file readable only
  // when it unlinked it itself): a SIGBUS at the next page read back after
  // the page cache dropped it. An evictor holds the exclusive lock from
  // just before its unlink: the entry is then taken as missing, as is a
  // file no longer at the name once locked. A filesystem without locks
  // gives no such guard; the entry is mapped all the same. (NFS makes
  // flock a POSIX lock, which a process drops when it closes any of its
  // descriptors of the file: a second load of the entry in the process
  // that lets its array go also drops the first one's. The guard is best
  // effort there.)
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    struct stat named{};
    if (::lstat(path.c_str(), &named) != 0 || named.st_dev != st.st_dev || named.st_ino != st.st_ino) {
      if (refused != nullptr) *refused = FileId{};
      return {};
    }
  } else if (errno == EWOULDBLOCK) {
    if (refused != nullptr) *refused = FileId{};  // a whole entry, being removed
    return {};
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) return {};
  // The descriptor (and its lock) goes with the mapping.
  closer.fd = -1;
  std::shared_ptr<const void> owner(base, [bytes, fd](const void* p) {
    ::munmap(const_cast<void*>(p), bytes);
    ::close(fd);
  });
  // The file's data, not the mapping's, is checked (DataHasCrc): the same
  // file (this descriptor's), and entries are replaced, never rewritten. A
  // cut made since the fstat above fails the check, and the entry is
  // decoded and written again.
  if (before_mapping_check_hook) before_mapping_check_hook(path);
  if (!DataHasCrc(fd, static_cast<off_t>(header_bytes), h.data_bytes, h.crc)) return {};
  out.data = static_cast<const uint8_t*>(base) + header_bytes;
  out.size = h.data_bytes;
  out.owner = std::move(owner);
  if (refused != nullptr) *refused = FileId{};
  return out;
}

// What WriteEntry did.
enum class Written {
  kInPlace,  // the entry written is at its name
  kFailed,   // nothing was put in place (reported)
  kPresent,  // another file was at the name, and was left there (`replace` false)
};

void EvictLeastRecentlyUsed(const std::string& dir, uint64_t max_bytes, uint64_t free_bytes = 0);

// The filesystem of `dir` in `*fs`, when statvfs measures it: some report
// no size at all (zero blocks: a tmpfs mounted with size=0, which has no
// limit, some FUSE filesystems), which says nothing of their free space.
bool Measure(const std::string& dir, struct statvfs* fs) {
  return ::statvfs(dir.c_str(), fs) == 0 && fs->f_frsize != 0 && fs->f_blocks != 0;
}

// Whether the filesystem of `dir` has room for an entry of `bytes` at
// `path`, after removing the least recently used entries (as eviction does,
// never one in use) for what it lacks: a cache on a full disk (a small home
// partition) otherwise kept its old entries (of sources since changed, of
// sets no longer loaded) and failed to write every new one, every run.
// Where there is still no room, the failure is reported and nothing is
// written: a write fills the disk to its last block before it fails, and a
// checkpoint or a log written meanwhile (by this job or another) would fail
// with it. Space counts in whole blocks (one more for the file's own
// metadata); a filesystem that statvfs cannot measure (Measure) is written
// to as before.
bool MakeRoom(const std::string& dir, const std::string& path, uint64_t bytes) {
  struct statvfs fs{};
  if (!Measure(dir, &fs)) return true;
  const uint64_t block = fs.f_frsize;
  const uint64_t need = (bytes / block + 2) * block;
  uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * block;
  if (free_bytes >= need) return true;
  EvictLeastRecentlyUsed(dir, DecodedCacheMaxBytes(), need - free_bytes);
  if (!Measure(dir, &fs)) return true;
  free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes >= need) return true;
  ReportWriteFailure(path, std::string(std::strerror(ENOSPC)) + " (the entry takes " + std::to_string(bytes) +
                               " bytes, " + std::to_string(free_bytes) + " are free in " + dir +
                               " after removing the least recently used entries)");
  return false;
}

// Writes an entry for `sources` (best effort) through AtomicFileWriter:
// readers never see part of one, and the temporary files of killed writers
// are removed by the next one. With `replace` false, a file at the entry's
// name (put there since the caller looked) is left as it is
// (AtomicFileWriter::CommitUnlessPresent). A failure is reported (once per
// process).
Written WriteEntry(const std::string& dir, const std::string& path, const std::vector<SourceStat>& sources,
                   const std::vector<int64_t>& dims, const std::vector<uint8_t>& data, bool replace) {
  if (dims.empty() || dims.size() > kMaxDims) return Written::kFailed;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    ReportWriteFailure(path, dir + " is not a folder" + (ec ? " (" + ec.message() + ")" : ""));
    return Written::kFailed;
  }
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.data_bytes = data.size();
  h.ndims = static_cast<uint32_t>(dims.size());
  h.nsources = static_cast<uint32_t>(sources.size());
  h.crc = Crc(data.data(), data.size());
  const uint64_t entry_bytes = sizeof(h) + sizeof(SourceStat) * sources.size() + 8 * dims.size() + data.size();
  if (!MakeRoom(dir, path, entry_bytes)) {
    return Written::kFailed;
  }
  // A FIFO, socket or device under an entry's name in the cache folder is
  // in the cache's own namespace, not a file of the user's: it goes, and
  // the entry takes its place (AtomicFileWriter refuses to replace one).
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0 &&
      (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) || S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))) {
    ::unlink(path.c_str());
  }
  // A write that runs out of room despite MakeRoom (a quota, EDQUOT, which
  // statvfs does not show; another file written meanwhile) makes room as
  // MakeRoom would, for the whole entry, and is tried once more: the cache
  // over its quota otherwise never evicted, and every run decoded again.
  for (int attempt = 0;; ++attempt) {
    try {
      io::AtomicFileWriter out(path);
      out.Write(&h, sizeof(h));
      for (const SourceStat& source : sources) out.Write(&source, sizeof(source));
      for (int64_t d : dims) {
        const uint64_t dim = static_cast<uint64_t>(d);
        out.Write(&dim, sizeof(dim));
      }
      out.Write(data.data(), data.size());
      if (!replace) return out.CommitUnlessPresent() ? Written::kInPlace : Written::kPresent;
      out.Commit();
      return Written::kInPlace;
    } catch (const io::FileWriteError& e) {
      if (e.in_place()) {
        // The entry is whole at its name (only the folder's fsync failed):
        // it is used, as any entry written; a crash may lose its name, and
        // the load after it then writes it again.
        ReportSyncFailure(e.what());
        return Written::kInPlace;
      }
      // The writer has removed its temporary by now (its destructor ran).
      if (attempt == 0 && (e.error_number() == ENOSPC || e.error_number() == EDQUOT)) {
        EvictLeastRecentlyUsed(dir, DecodedCacheMaxBytes(), entry_bytes);
        continue;
      }
      ReportWriteFailure(path, e.what());
      return Written::kFailed;
    } catch (const io::CheckpointError& e) {
      // An unwritable cache (full disk, read-only folder) leaves loads as
      // they were, decoding.
      ReportWriteFailure(path, e.what());
      return Written::kFailed;
    }
  }
}

// A lock file that could be made but not locked (NFS mounted without locks
// answers flock with ENOLCK): the entry is written without the lock, so
// processes that load a set into a cold cache at once each decode it (and
// write it) instead of one; the job says once where and why
// (SaysForTheJob): every one of its processes that loads a set into a cold
// cache meets it, on the same filesystem. (A local rank 0 that finds the
// entry another rank wrote, at its first look, meets it not: it decoded
// nothing.)
void ReportLockFailure(const std::string& lock_path, int err) {
  if (lock_failure_reported.exchange(true)) return;
  if (!SaysForTheJob(kLockReportedEnv, DecodedCacheDir())) return;
  std::fprintf(stderr,
               "[ddp] warning: decoded dataset cache: cannot lock %s: %s; entries are written without the lock, "
               "so ranks loading a set into a cold cache each decode it (DDP_DATA_CACHE=<folder> on a local "
               "disk moves the cache, DDP_DATA_CACHE=off turns it off)\n",
               lock_path.c_str(), std::strerror(err));
}

// How old a lock file must be to be removed where the filesystem has no
// locks (RemoveLockUnlessHeld): far beyond any decode and write, and beyond
// the clock skew between an NFS server, whose clock sets the file's time,
// and this host.
constexpr std::chrono::hours kUnlockableLockAge{1};

// Whether the file `st` describes was last modified more than `age` ago.
bool OlderThan(const struct stat& st, std::chrono::seconds age) {
  struct timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return now.tv_sec - st.st_mtim.tv_sec > static_cast<time_t>(age.count());
}

// Marks the entry at `path` used now: eviction goes by modification time,
// oldest first. Best effort (a read-only cache keeps its times).
void MarkUsed(const std::string& path) { ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0); }

// Removes the lock file `path` (`<entry>.lock`) unless a process holds it.
// A holder removes its lock file itself (EntryLock), so one that no one
// holds was left by a process killed while it decoded; nothing else
// removes it (a set not loaded again kept its lock file forever). The
// file is unlinked while this locks it, and only when the name still leads
// to the file locked: a process that opened the file before the unlink and
// locks it after finds it gone (EntryLock checks the same) and makes
// another. Only an empty regular file is taken for a lock file.
//
// Where this mount has no locks (flock fails with other than EWOULDBLOCK),
// whether a process holds the file cannot be known: it is removed once it
// is older than kUnlockableLockAge. Such a file was left by a process
// killed while it decoded (EntryLock removes at once a file it cannot lock,
// so none stays from a load here otherwise), or is held by a load of a host
// that mounts the folder with locks: no decode and write takes that long,
// and that host's waiters stop waiting after kEntryLockWait. Were one held
// all the same, its holder would only lose its turn, as with EntryLock's
// own removal: the entry is written whole whoever writes it. Without this,
// such a file stayed beside the entries forever.
void RemoveLockUnlessHeld(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != 0) return;
  // Read-write, as EntryLock opens it: NFS refuses an exclusive lock on a
  // read-only descriptor; a file this user may only read is tried read-only.
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == EACCES) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return;
  struct stat held{}, named{};
  const bool locked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  const bool no_locks = !locked && errno != EWOULDBLOCK && errno != EINTR;  // EWOULDBLOCK: a load is decoding
  if ((locked || no_locks) && ::fstat(fd, &held) == 0 && S_ISREG(held.st_mode) && held.st_size == 0 &&
      (locked || OlderThan(held, kUnlockableLockAge)) && ::lstat(path.c_str(), &named) == 0 &&
      held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
    ::unlink(path.c_str());
  }
  ::close(fd);
}

constexpr std::string_view kEntrySuffix = ".decoded";
constexpr std::string_view kLockSuffix = ".decoded.lock";

bool EndsWith(const std::string& name, std::string_view suffix) {
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Removes the lock files (`*.decoded.lock`) of `dir` that no process holds
// (RemoveLockUnlessHeld), after a load from an entry: a job whose loads all
// find their entries writes none, so eviction, which removes them too, never
// ran and they stayed. Safe beside a writer for the reasons eviction is: a
// held lock is left, and one unlinked under a process about to lock it is
// made again by that process. Costs a read of the folder and an lstat per
// lock file (microseconds for a folder of a few hundred files, against the
// milliseconds of the CRC of an entry).
void RemoveUnheldLocks(const std::string& dir) {
  std::vector<std::string> locks;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (EndsWith(it->path().filename().string(), kLockSuffix)) locks.push_back(it->path().string());
  }
  for (const std::string& lock : locks) RemoveLockUnlessHeld(lock);
}

// Unlinks the entry at `path` unless a process has it mapped (MapEntry
// holds a shared lock on it meanwhile); true when it is gone. Unlinked
// while this holds the exclusive lock, and only when the name still leads
// to the file locked (an entry put in its place since is another's). Where
// the filesystem has no locks it is unlinked unguarded, as before there
// were any.
bool RemoveEntryUnlessMapped(const std::string& path) {
  // Read-write: NFS refuses an exclusive lock on a read-only descriptor.
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == EACCES) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return ::unlink(path.c_str()) == 0 || errno == ENOENT;
  bool gone = false;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    struct stat held{}, named{};
    gone = ::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
           held.st_ino == named.st_ino && ::unlink(path.c_str()) == 0;
  } else if (errno != EWOULDBLOCK && errno != EINTR) {
    gone = ::unlink(path.c_str()) == 0 || errno == ENOENT;
  }
  ::close(fd);
  return gone;
}

// Removes the least recently used entries of `dir` (by modification time,
// see MarkUsed) until those left take at most `max_bytes` and those removed
// at least `free_bytes` (room for a new entry, see MakeRoom), never one this
// process wrote or loaded (NoteInUse), kept even when they alone are
// larger: then a warning says so, once per process. Only whole entries
// (`*.decoded`) are candidates: temporaries being written and lock files
// have other names. An entry another process has mapped is left too
// (RemoveEntryUnlessMapped), past the limit as well. Safe beside other
// processes: one that was about to open an entry removed decodes and
// writes it again. Lock files (`*.decoded.lock`) that no
// process holds are removed too, whatever the size (RemoveLockUnlessHeld).
// Best effort, otherwise silent.
void EvictLeastRecentlyUsed(const std::string& dir, uint64_t max_bytes, uint64_t free_bytes) {
  struct Candidate {
    int64_t mtime_ns;
    std::string path;
    uint64_t bytes;
  };
  std::vector<Candidate> entries;
  std::vector<std::string> locks;
  uint64_t total = 0, in_use_bytes = 0;
  std::error_code ec;
  std::lock_guard<std::mutex> l(InUse().mu);
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (EndsWith(name, kLockSuffix)) {
      locks.push_back(it->path().string());
      continue;
    }
    if (!EndsWith(name, kEntrySuffix) || name.find(".decoded.tmp.") != std::string::npos) continue;
    struct stat st;
    const std::string path = it->path().string();
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    total += static_cast<uint64_t>(st.st_size);
    if (InUse().paths.count(path) != 0) {
      in_use_bytes += static_cast<uint64_t>(st.st_size);
      continue;
    }
    entries.push_back({static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec, path,
                       static_cast<uint64_t>(st.st_size)});
  }
  // Said by each process that meets it, not once per job (SaysForTheJob):
  // it names the bytes this process uses, and only a process that writes an
  // entry evicts (one that maps its sets from entries never does), which
  // may be any rank.
  if (in_use_bytes > max_bytes && !limit_below_use_reported.exchange(true)) {
    std::fprintf(stderr,
                 "[ddp] warning: the decoded dataset cache %s may keep %llu bytes "
                 "(DDP_DATA_CACHE_MAX_BYTES), less than the %llu bytes of entries this process "
                 "uses; they are kept, since evicting them would make every run decode and write "
                 "them again. Raise DDP_DATA_CACHE_MAX_BYTES, or set DDP_DATA_CACHE=off to cache "
                 "nothing\n",
                 dir.c_str(), static_cast<unsigned long long>(max_bytes),
                 static_cast<unsigned long long>(in_use_bytes));
  }
  for (const std::string& lock : locks) RemoveLockUnlessHeld(lock);
  if (total <= max_bytes && free_bytes == 0) return;
  std::sort(entries.begin(), entries.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.mtime_ns, a.path) < std::tie(b.mtime_ns, b.path);
  });
  uint64_t freed = 0;
  for (const Candidate& e : entries) {
    if (total <= max_bytes && freed >= free_bytes) break;
    if (RemoveEntryUnlessMapped(e.path)) {
      total -= e.bytes;
      freed += e.bytes;
    }
  }
}

// An exclusive flock on `<entry>.lock`, so that the processes of a host
// loading one set into a cold cache decode and write it once: the others wait
// for the entry and map it. Not held when the file cannot be made (an
// unwritable folder), cannot be locked (a filesystem without locks), or
// another process holds it past `wait` (a stuck writer: the caller then
// decodes alone). The holder removes the file before
// unlocking it, so none is left; a waiter whose lock is on a removed file
// (it opened the file before the removal, or a sweep removed it as
// unheld: RemoveUnheldLocks) locks the path again. A file that cannot be locked is removed
// at once: the filesystem refuses every process that reaches it through
// this mount alike, so no one here could hold it, and it would stay beside
// the entry forever. (A host that shares the cache folder through a mount
// that does lock, and sees the same sources, may hold it meanwhile: it
// then only loses its turn, and writes a whole entry too.)
class EntryLock {
 public:
  EntryLock(std::string path, std::chrono::milliseconds wait) : path_(std::move(path)) {
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (true) {
      fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd_ < 0) {
        open_errno_ = errno;
        return;
      }
      while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) {
          lock_errno_ = errno;
          ::unlink(path_.c_str());
          Drop();
          return;
        }
        if (std::chrono::steady_clock::now() >= deadline) {
          Drop();
          return;
        }
        ::usleep(5000);
      }
      struct stat held, named;
      if (::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
          held.st_ino == named.st_ino) {
        return;
      }
      Drop();
      if (std::chrono::steady_clock::now() >= deadline) return;
    }
  }
  ~EntryLock() {
    if (fd_ < 0) return;
    ::unlink(path_.c_str());  // while still locked: see the class comment
    Drop();
  }
  EntryLock(const EntryLock&) = delete;
  EntryLock& operator=(const EntryLock&) = delete;
  bool held() const { return fd_ >= 0; }
  /// The errno of a lock file that could not be made (0: it could).
  int open_errno() const { return open_errno_; }
  /// The errno of a lock file that was made but could not be locked (0: none).
  int lock_errno() const { return lock_errno_; }

 private:
  void Drop() {
    ::close(fd_);
    fd_ = -1;
  }
  std::string path_;
  int fd_ = -1;
  int open_errno_ = 0;
  int lock_errno_ = 0;
};

// The outermost folder on the way to `dir` that does not exist yet ("" when
// `dir` exists): what create_directories(dir) would make, from there down.
std::string FirstMissingFolder(const std::string& dir) {
  std::error_code ec;
  std::filesystem::path missing;
  for (std::filesystem::path p = dir; !p.empty() && !std::filesystem::exists(p, ec) && !ec;
       p = p.parent_path()) {
    missing = p;
    if (p == p.parent_path()) break;
  }
  return missing.string();
}

// Removes the folders from `dir` up to `made_from` (FirstMissingFolder
// before they were made) while they are empty: rmdir leaves a folder that
// another process has put a file in meanwhile, and that process makes the
// folder again when this one removed it first (LoadDecoded).
void RemoveFoldersMade(const std::string& dir, const std::string& made_from) {
  if (made_from.empty()) return;
  for (std::filesystem::path p = dir;; p = p.parent_path()) {
    if (::rmdir(p.c_str()) != 0 || p == std::filesystem::path(made_from) || p == p.parent_path()) return;
  }
}

}  // namespace

std::string DecodedCacheDir() {
  const char* env = std::getenv("DDP_DATA_CACHE");
  if (env != nullptr && env[0] != '\0') {
    // The usual ways of saying "off", in any case: a value taken for a
    // folder name instead (DDP_DATA_CACHE=false) cached into ./false,
    // relative to each rank's working directory, without a word.
    std::string v = env, lower = v;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    for (const char* off : {"0", "off", "false", "no", "none"}) {
      if (lower == off) return "";
    }
    // One spelling of the folder whatever the user typed: "/scratch/cache/"
    // is "/scratch/cache" (paths made from it are compared with a
    // listing's), and "/" stays "/".
    while (v.size() > 1 && v.back() == '/') v.pop_back();
    return v;
  }
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/ddp/datasets";
  const char* home = std::getenv("HOME");
  if (home != nullptr && home[0] == '/') return std::string(home) + "/.cache/ddp/datasets";
  return "";
}

uint64_t DecodedCacheMaxBytes() {
  const char* env = std::getenv("DDP_DATA_CACHE_MAX_BYTES");
  if (env == nullptr || env[0] == '\0') return kDefaultCacheMaxBytes;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (errno != 0 || *end != '\0' || !std::isdigit(static_cast<unsigned char>(env[0]))) {
    static std::atomic<bool> reported{false};
    if (!reported.exchange(true)) {
      std::fprintf(stderr,
                   "[ddp] warning: DDP_DATA_CACHE_MAX_BYTES=%s is not a byte count; the decoded dataset cache "
                   "keeps up to %llu bytes\n",
                   env, static_cast<unsigned long long>(kDefaultCacheMaxBytes));
    }
    return kDefaultCacheMaxBytes;
  }
  return static_cast<uint64_t>(v);
}

void ResetDecodedCacheWarningsForTesting() {
  for (const char* name : kReportedEnvs) {
    if (std::getenv(name) != nullptr) ::setenv(name, "", 1);  // in place, as SaysForTheJob
  }
  write_failure_reported = false;
  limit_below_use_reported = false;
  lock_failure_reported = false;
  sync_failure_reported = false;
}

void SetBeforeMappingCheckHookForTesting(std::function<void(const std::string&)> hook) {
  before_mapping_check_hook = std::move(hook);
}

void ForgetDecodedEntriesInUseForTesting() {
  std::lock_guard<std::mutex> l(InUse().mu);
  InUse().paths.clear();
}

SharedArray LoadDecoded(const std::vector<std::string>& sources,
                        const DecodeFn& decode,
                        size_t min_bytes,
                        std::chrono::milliseconds lock_wait,
                        const DecodedSizeFn& decoded_size) {
  // The decoded bytes, owned by the result (no entry behind them).
  const auto in_memory = [](std::vector<int64_t> dims, std::vector<uint8_t> bytes) {
    auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
    SharedArray out;
    out.dims = std::move(dims);
    out.data = owned->data();
    out.size = owned->size();
    out.owner = std::move(owned);
    return out;
  };
  // A set too small to cache by its headers is decoded without a look at
  // the folder: the lock file made and removed around its decode (and the
  // folder, where it did not exist) changed the folder's times and woke
  // whatever watched it, for a set never written there.
  if (decoded_size != nullptr) {
    const std::optional<uint64_t> size = decoded_size();
    if (size.has_value() && *size < min_bytes) {
      auto [dims, bytes] = decode();
      return in_memory(std::move(dims), std::move(bytes));
    }
  }
  const std::string dir = DecodedCacheDir();
  std::vector<SourceStat> stats;
  const bool cacheable = !dir.empty() && StatSources(sources, &stats);
  // Spelled as a listing of `dir` spells it (EvictLeastRecentlyUsed
  // compares the two to keep the entries in use).
  const std::string path = cacheable ? (std::filesystem::path(dir) / EntryName(sources, stats)).string() : "";
  std::unique_ptr<EntryLock> lock;
  std::error_code mkdir_error;
  std::string made_from;  // the outermost folder of `dir` this load makes ("" when none)
  // An entry mapped: marked used and kept, and the stale lock files of the
  // folder removed (RemoveUnheldLocks), since this load writes nothing.
  const auto use = [&](SharedArray hit) {
    MarkUsed(path);
    NoteInUse(path);
    RemoveUnheldLocks(dir);
    return hit;
  };
  if (cacheable) {
    SharedArray hit = MapEntry(path, stats);
    if (hit.owner != nullptr) return use(std::move(hit));
    made_from = FirstMissingFolder(dir);
    std::filesystem::create_directories(dir, mkdir_error);
    lock = std::make_unique<EntryLock>(path + ".lock", lock_wait);
    if (!lock->held() && lock->open_errno() == ENOENT) {
      // A load of a set too small to cache removed the folder it had made
      // (RemoveFoldersMade) between the making above and the lock file.
      std::filesystem::create_directories(dir, mkdir_error);
      lock = std::make_unique<EntryLock>(path + ".lock", lock_wait);
    } else if (!lock->held() && (lock->open_errno() == ENOSPC || lock->open_errno() == EDQUOT)) {
      // A disk (or quota) so full that not even the empty lock file fits:
      // the least recently used entries not in use make room for it (and
      // stale lock files go), as they do for an entry (MakeRoom). Without
      // this the disk stayed full, and every run decoded and warned.
      EvictLeastRecentlyUsed(dir, DecodedCacheMaxBytes(), /*free_bytes=*/1);
      lock = std::make_unique<EntryLock>(path + ".lock", lock_wait);
    }
    // Another process may have written the entry while this one waited.
    if (lock->held()) hit = MapEntry(path, stats);
    if (hit.owner != nullptr) return use(std::move(hit));
  }
  auto [dims, bytes] = decode();
  if (bytes.size() < min_bytes && lock != nullptr) {
    // Too small to cache: the lock file goes now, and the folders this
    // load made for nothing with it (a test's scratch set made the cache
    // folder in the user's home).
    lock.reset();
    RemoveFoldersMade(dir, made_from);
  }
  if (lock != nullptr && !lock->held() && lock->open_errno() != 0 && bytes.size() >= min_bytes) {
    // No lock file: the folder cannot be written (or made), so no entry
    // can be either. (A lock held too long by another process is no
    // failure: that one writes the entry.)
    ReportWriteFailure(path, mkdir_error ? "cannot make the folder " + dir + ": " + mkdir_error.message()
                                         : std::string(std::strerror(lock->open_errno())));
  }
  const bool no_locks = lock != nullptr && lock->lock_errno() != 0;
  FileId refused;  // the file at the entry's name that the look below found no valid entry
  if (no_locks && bytes.size() >= min_bytes) {
    ReportLockFailure(path + ".lock", lock->lock_errno());
    // Without the lock, another process may have written the entry while
    // this one decoded: it is mapped, not written again (a whole write and
    // fsync for nothing, and this load's bytes would be a private copy
    // beside the page cache's). Where hosts share the entry (a cache folder
    // on NFS, the same source files), a rename over it would also unlink
    // the file under another host's ranks that have it mapped (an NFS
    // client keeps an unlinked file readable only when it unlinked it).
    SharedArray hit = MapEntry(path, stats, &refused);
    if (hit.owner != nullptr) return use(std::move(hit));
  }
  // Only the lock's holder writes: one whole entry, not one per rank. Where
  // the filesystem has no locks, every load writes: the writes are atomic
  // (each puts a whole entry in place), so the only cost is ranks of a cold
  // cache each writing one, against decoding the set on every load of every
  // later run when none was written.
  if (lock != nullptr && (lock->held() || no_locks) && bytes.size() >= min_bytes) {
    // A source replaced or rewritten during the decode may have given either
    // file's bytes: an entry would pair the identity stated before with the
    // other contents, so none is written.
    std::vector<SourceStat> after;
    if (StatSources(sources, &after) && after == stats) {
      // Without the lock, another process may put its entry in place while
      // this one writes (the look above comes a whole write and fsync
      // before): the entry is linked into place, never over a file at the
      // name, and one that came meanwhile is mapped instead. A file that the
      // look refused (a corrupt entry) is unlinked first, and only while the
      // name still leads to it: renaming over it, as the lock's holder does,
      // let two loads that found it corrupt replace each other's whole
      // entries, under ranks that had the first mapped. (Removing another
      // load's entry here would take that load unlinking the same file and
      // writing, fsyncing and linking a whole entry between this lstat and
      // this unlink.)
      struct stat st{};
      if (no_locks && refused.found && ::lstat(path.c_str(), &st) == 0 && st.st_dev == refused.dev &&
          st.st_ino == refused.ino) {
        ::unlink(path.c_str());
      }
      switch (WriteEntry(dir, path, stats, dims, bytes, /*replace=*/!no_locks)) {
        case Written::kInPlace:
          NoteInUse(path);
          EvictLeastRecentlyUsed(dir, DecodedCacheMaxBytes());
          break;
        case Written::kPresent: {
          SharedArray hit = MapEntry(path, stats);
          if (hit.owner != nullptr) return use(std::move(hit));
          break;
        }
        case Written::kFailed:
          break;
      }
    }
  }
  lock.reset();
  return in_memory(std::move(dims), std::move(bytes));
}

SharedArray LoadDecoded(const std::string& source,
                        const DecodeFn& decode,
                        size_t min_bytes,
                        std::chrono::milliseconds lock_wait,
                        const DecodedSizeFn& decoded_size) {
  return LoadDecoded(std::vector<std::string>{source}, decode, min_bytes, lock_wait, decoded_size);
}

}  // namespace ddp::nn::data::internal
