#ifndef DDP_NN_IO_ATOMIC_FILE_H_
#define DDP_NN_IO_ATOMIC_FILE_H_

// Crash-safe replacement of a file: readers of `path` see the old content or
// the new one, never a mix or a prefix.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "nn/io/safetensors.h"

namespace ddp::nn::io {

/// Long writes and reads check their stop flag (when given one) before each
/// piece of this size, so that a caller past its deadline gets its thread
/// back within one piece's time.
inline constexpr size_t kStopCheckBytes = size_t{64} << 20;

/// A system call of an AtomicFileWriter (or SyncFolder) that failed, with
/// its errno: a caller that can make room (a cache evicting entries) tells
/// a full disk (ENOSPC) or a quota reached (EDQUOT) from other failures.
class FileWriteError : public CheckpointError {
 public:
  FileWriteError(const std::string& what, int err, bool in_place = false)
      : CheckpointError(what), error_number_(err), in_place_(in_place) {}
  /// The errno of the failed call.
  int error_number() const { return error_number_; }
  /// Whether the new file was already in place (renamed or linked to the
  /// target's name, whole and fsynced) when the fsync of its folder failed:
  /// readers see it; only its name's surviving a crash is in doubt.
  bool in_place() const { return in_place_; }

 private:
  int error_number_;
  bool in_place_;
};

/// The file an AtomicFileWriter at `path` replaces: `path` itself, or the
/// file the symbolic link(s) at `path` lead to. Throws CheckpointError, as
/// the writer would, for a loop or a dangling link whose folder is missing.
std::string AtomicWriteTarget(const std::string& path);

/// Whether `path` is a FIFO or a terminal: a reader takes what is written
/// there as it comes, so a writer streams to it rather than replacing it
/// (an AtomicFileWriter's rename would put a regular file in its place).
/// Told without opening it (an open alone acts on some devices); false for
/// anything else, or when it cannot be looked at.
bool IsStreamPath(const std::string& path);

/// Writes a new version of a file beside it and swaps it in on Commit().
/// Destroying the writer without Commit() removes the temporary file and
/// leaves `path` as it was. Errors throw CheckpointError naming the path
/// first (as given; then the file a link leads to), and after the reason
/// the temporary file a failed system call was about.
/// When `path` is a symbolic link (or a chain of them, up to 40), the file
/// it leads to is the one replaced, from a temporary in that file's folder,
/// and the link stays as it is (as torch.save writes through a link). A
/// dangling link's target is created when its folder exists; otherwise, and
/// for a loop, the error names the link and the target.
class AtomicFileWriter {
 public:
  /// Creates `<path>.tmp.<pid>.<n>-<nonce>.<host>` (the nonce random, one
  /// per process; a name already taken is passed over for the next; for a
  /// file name too long to take that within 255 bytes with any host name
  /// (up to 64 bytes), that is longer than 148 bytes, its first 100 bytes
  /// and its CRC-32 stand for it, on every host alike) in the folder of
  /// `path`, first removing such files that no writer holds locked any more (killed
  /// writers; another host's only once also unchanged for an hour; see
  /// RemoveStaleTemporaries in the .cc). Throws naming `path`,
  /// and what it is, when it (or the file its link leads to) exists but is
  /// not a regular file (a folder, a FIFO, a socket, a device), before any
  /// file is made or removed: the rename would replace it. Once `*stop`
  /// (when given) is true, Write and Commit throw CheckpointError
  /// ("stopped") before their next piece, leaving `path` as it was; Commit
  /// looks again after its fsync, before the rename (in step with
  /// OrderedStop::Stop when the flag has one).
  explicit AtomicFileWriter(std::string path, const std::atomic<bool>* stop = nullptr);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends bytes to the temporary file, kStopCheckBytes at a time.
  void Write(const void* data, size_t nbytes);
  /// fsync, rename over the target, fsync the folder. Call at most once.
  /// A failed folder fsync throws FileWriteError with in_place() true.
  /// Throws as the constructor does, removing the temporary and leaving the
  /// target as it is, when something other than a regular file has taken
  /// the target's place since the writer was made (a FIFO, a device, a
  /// folder, a symbolic link).
  /// After a Write or Commit that threw before the rename (the temporary may
  /// hold part of the data, or data an fsync failed to keep), Write and
  /// Commit throw, so that what is left is never renamed into place.
  void Commit();
  /// As Commit, but never replaces a file at the target: the temporary is
  /// hard-linked to the target's name, which fails where the name is
  /// taken, then its own name is removed. Returns false, removing the
  /// temporary and leaving the file at the target as it is, when a file is
  /// there (put there before the writer was made or since); true
  /// when the new file is in place. For writers of one content that several
  /// processes may write at once without a lock (each would otherwise unlink
  /// the other's file under its readers). Where the filesystem makes no hard
  /// links, the target is looked up just before a rename: a file put there
  /// between the two is replaced. Call at most once, instead of Commit.
  [[nodiscard]] bool CommitUnlessPresent();
  /// Path of the temporary file (for tests).
  const std::string& temp_path() const { return temp_path_; }

 private:
  // The path as given; path_ is the file it leads to (itself, or the
  // target of its symbolic links).
  std::string asked_;
  std::string path_;
  std::string temp_path_;
  const std::atomic<bool>* stop_;
  int fd_ = -1;
  bool committed_ = false;
  // Set while a Write or Commit runs, and left set when one throws.
  bool failed_ = false;

  // Commit (`replace`) or CommitUnlessPresent.
  bool Place(bool replace);
  // The target as errors name it: the path asked for, and the file its
  // link leads to when it is one.
  std::string Named() const;
  // Throws FileWriteError for system call `what` that failed with `err`,
  // naming the target first and then the temporary file it was about.
  [[noreturn]] void FailOnTemporary(const std::string& what, int err) const;
  // Throws when asked to stop.
  void CheckStop() const;
  // Throws when an earlier Write or Commit threw.
  void CheckNotFailed() const;
};

/// Puts the setting of a stop flag and the renames of the AtomicFileWriters
/// watching it in one order, so that a caller past its deadline knows
/// whether it may still say "the file was left as it was": each writer's
/// Commit either sees the flag at its last check and leaves its target
/// alone, or had passed that check before Stop() and renames its file
/// into place. Lives no longer than the flag; one per flag.
class OrderedStop {
 public:
  explicit OrderedStop(std::atomic<bool>& stop);
  ~OrderedStop();
  OrderedStop(const OrderedStop&) = delete;
  OrderedStop& operator=(const OrderedStop&) = delete;

  /// Sets the flag. Returns true when a writer watching it had already
  /// passed its last check (its new file is, or is about to be, in place).
  bool Stop();

 private:
  std::atomic<bool>& stop_;
};

/// fsyncs `folder`, so that entries made in it (a rename, a new folder)
/// outlast a crash. A filesystem that cannot fsync a folder (see
/// internal::FolderFsyncUnsupported) is no error: there is nothing more to
/// do. Throws CheckpointError naming the folder for other failures.
void SyncFolder(const std::string& folder);

namespace internal {

/// Whether errno `err` from fsync of a folder says the filesystem does not
/// do that (EINVAL, EROFS, ENOTSUP, EBADF), rather than that it failed.
bool FolderFsyncUnsupported(int err);

/// Makes every AtomicFileWriter::Write sleep `pause` before each piece of
/// kStopCheckBytes (before its stop check), as a slow disk would, so that
/// tests of deadlines and heartbeats around long writes do not depend on how
/// fast the disk or the page cache is. Process-wide; zero (the default)
/// turns it off and ends the pauses under way. For tests only.
void SetWritePausePerPiece(std::chrono::milliseconds pause);

/// Makes every AtomicFileWriter::Commit sleep `pause` after its last stop
/// check, before its rename, as a rename on a slow filesystem would: the
/// window in which a stop comes too late. Process-wide; zero (the default)
/// turns it off and ends the pauses under way. For tests only.
void SetPauseBeforeRenameForTesting(std::chrono::milliseconds pause);

/// How many pauses of the two functions above have begun in this process,
/// so that a test can act once a writer is inside one (and then end it by
/// setting the pause to zero) rather than after a fixed time. For tests
/// only.
int64_t PausesBegunForTesting();

/// Calls `hook` with the temporary file's path as soon as an
/// AtomicFileWriter has created it (before anything else is done to it), so
/// that a test can see what another process could at that moment.
/// Process-wide; an empty function (the default) turns it off. Set it only
/// while no writer runs. For tests only.
void SetTemporaryCreatedHookForTesting(std::function<void(const std::string&)> hook);

}  // namespace internal

}  // namespace ddp::nn::io

#endif  // DDP_NN_IO_ATOMIC_FILE_H_
