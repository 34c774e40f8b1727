#ifndef DDP_NN_DATA_DECODED_CACHE_H_
#define DDP_NN_DATA_DECODED_CACHE_H_

// Decoded dataset files kept on disk, so that a later load maps them instead
// of decompressing: the page cache then holds one copy of the pixels for
// every process that loads the set (a job's ranks, its launcher, the next
// run). Fashion-MNIST's training images take ~0.3 s and 47 MB of fresh memory
// per process to decompress, and ~15 ms to map and check.
//
// An entry is keyed by its source files (their paths, inodes, sizes,
// modification and change times, stated before the decode and again after
// it: a source that changed meanwhile gets no entry; not their device
// numbers, which an overlay or NFS mount changes at each mount) and carries a CRC-32 of
// its data: an entry that does not match is ignored and written again. The
// entry's name hashes the same key, not the host name: hosts sharing a cache
// folder keep an entry each for copies of a set that differ, share one for
// the same files, and a container whose host name changes at each restart
// finds its entries on a persistent volume; a source that changes gets a
// new name (its old entry goes with the least recently used, see Size).
// Entries are written to a temporary file and renamed into place, so a
// reader sees a whole entry or none. An entry cut short in place by another
// program is refused at the next load (its size is checked against its
// header before it is mapped, and its CRC is read with pread, not through
// the mapping, so that a cut made meanwhile fails the check, not the
// process) and written again. An entry truncated in place while a process
// has it mapped (after its load) kills that process with SIGBUS at its next
// read past the cut, as any memory-mapped file does (PyTorch's mmap loads
// too); one rewritten in place (a cp over it truncates it first) may do
// the same, or hand the process the new bytes unchecked. The cache installs
// no signal handler: the process's SIGBUS action stays the one its program
// set. So no tool other than the cache may change or remove the files in
// its folder while jobs run. The cache is best effort: where it
// cannot be read or written, loads decode as before (the first entry that
// cannot be written says so on stderr with the path and the cause, once
// per job: from the process outside a launcher that meets it, else from
// each node's local rank 0; so does, and apart, the first lock file that
// cannot be locked, as on NFS mounted without locks: entries are then
// written without the lock, so concurrent first loads each decode; and,
// once per process that meets it, the first entry put in place whose
// folder then cannot be fsynced: it is used all the same).
//
// Size: after writing an entry, the least recently used others (by
// modification time, which a load from an entry sets to now) are removed
// until the folder's entries take at most DecodedCacheMaxBytes(), except
// those this process wrote or loaded: they stay even past the limit (with a
// warning, once per process), since removing one would only make the next
// load decode and write it again; nor those another process has mapped (it
// holds a shared lock on the entry meanwhile: on NFS, a file another host
// unlinks is lost to the processes that have it mapped). Where the
// filesystem has no locks, such an entry may go; a local process keeps
// reading it after the removal. Where the disk has no room for a new entry,
// the least recently used others (not those) are removed first for what it
// lacks; when that is not enough, the entry is not written (a write would
// fill the disk before failing) and the first such load says so. A write
// that runs out of room all the same (a quota, EDQUOT, which statvfs does
// not show; a file written meanwhile) removes them for the whole entry and
// is tried once more; so is a lock file that does not fit. Lock
// files that no process holds (left by a process killed while decoding)
// are removed then too, and at each load from an entry (a job whose loads
// all hit writes nothing); where the filesystem has no locks, once they are
// an hour old (whether one is held cannot be known there).
//
// Where: $DDP_DATA_CACHE (a folder; "0", "off", "false", "no" or "none", in
// any case, turns the cache off), else
// $XDG_CACHE_HOME/ddp/datasets, else $HOME/.cache/ddp/datasets.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddp::nn::data::internal {

/// Decoded bytes with their dimensions; `owner` keeps `data` alive (a
/// mapping of a cache entry, or a vector).
struct SharedArray {
  std::vector<int64_t> dims;
  std::shared_ptr<const void> owner;
  const uint8_t* data = nullptr;
  size_t size = 0;
};

/// The folder the cache uses now ("" when it is off or there is no home).
std::string DecodedCacheDir();

/// The bytes of entries a cache folder keeps when DDP_DATA_CACHE_MAX_BYTES
/// is not set: room for many sets (Fashion-MNIST's training images take
/// 47 MB, CIFAR-10's training batches 154 MB).
inline constexpr uint64_t kDefaultCacheMaxBytes = uint64_t{4} << 30;

/// The most bytes of entries the cache folder keeps: $DDP_DATA_CACHE_MAX_BYTES
/// (a decimal byte count; 0 keeps only the entries this process wrote or
/// loaded, removing every other one at each write), else
/// kDefaultCacheMaxBytes (also for a value that is not a byte count, with
/// a warning).
uint64_t DecodedCacheMaxBytes();

/// For tests only: lets the next failed write report itself again (and
/// forgets that this process reported one to the ranks it starts).
void ResetDecodedCacheWarningsForTesting();

/// For tests only: `hook` (null: none) is called with an entry's path once
/// the entry is mapped, before its data's CRC is checked. Not thread-safe:
/// set it while no load runs.
void SetBeforeMappingCheckHookForTesting(std::function<void(const std::string&)> hook);

/// For tests only: forgets the entries this process wrote or loaded, so
/// that eviction treats them as another process's.
void ForgetDecodedEntriesInUseForTesting();

/// Decoded files smaller than this are not cached: they decode in
/// microseconds, and tests' scratch files would pile up.
inline constexpr size_t kMinCachedBytes = size_t{1} << 20;

/// How long a load into a cold cache waits for another process that is
/// decoding the same sources (and will write their entry) before it decodes
/// alone, writing nothing.
inline constexpr std::chrono::milliseconds kEntryLockWait{60000};

/// The decoded contents of `sources` (one or more files, decoded together):
/// from their cache entry when one matches, else from `decode` (which
/// throws for a bad file), whose result is then written to the cache when
/// it has at least `min_bytes`. `decode` returns the dimensions and the
/// bytes. Concurrent first loads on one host take turns on a lock file next
/// to the entry (`<entry>.lock`, removed after): the first decodes and
/// writes, the others then map its entry; one that waits more than
/// `lock_wait` decodes alone and writes nothing. Where the lock file cannot
/// be locked (a filesystem without locks), each load writes the entry,
/// unless another wrote it during its decode or its write: it then maps
/// that one (the entry is linked into place, never over one that came
/// meanwhile; a file at the name that was no valid entry is unlinked
/// first, never renamed over). A set that `decoded_size` says has fewer
/// than `min_bytes` is decoded with the cache folder untouched: no look-up,
/// no lock file, no folder made. One whose size it does not give (no
/// `decoded_size`, or it returns std::nullopt) takes the lock before its
/// decode, as above; when it then has fewer than `min_bytes`, it leaves no
/// lock file, nor the cache folders the load made for it, though both
/// existed during the decode.
using DecodeFn = std::function<std::pair<std::vector<int64_t>, std::vector<uint8_t>>()>;
/// The number of bytes `decode` will return, read from the sources' headers
/// without decoding them; std::nullopt where they do not say.
using DecodedSizeFn = std::function<std::optional<uint64_t>()>;
SharedArray LoadDecoded(const std::vector<std::string>& sources, const DecodeFn& decode,
                        size_t min_bytes = kMinCachedBytes, std::chrono::milliseconds lock_wait = kEntryLockWait,
                        const DecodedSizeFn& decoded_size = nullptr);
SharedArray LoadDecoded(const std::string& source, const DecodeFn& decode, size_t min_bytes = kMinCachedBytes,
                        std::chrono::milliseconds lock_wait = kEntryLockWait,
                        const DecodedSizeFn& decoded_size = nullptr);

}  // namespace ddp::nn::data::internal

#endif  // DDP_NN_DATA_DECODED_CACHE_H_
