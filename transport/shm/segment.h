#ifndef DDP_TRANSPORT_SHM_SEGMENT_H_
#define DDP_TRANSPORT_SHM_SEGMENT_H_

// A POSIX shared-memory segment mapped by every rank of one host. Rank 0 of
// the group creates it under a fresh name (another one drawn, up to 8 in
// all, where the name exists already) and posts the name in the store;
// the others map it and say so; once all have mapped it the name is
// unlinked, so a crash later leaves nothing behind in /dev/shm. A name
// left by a job killed during set-up goes when a later group creates its
// segment (RemoveStaleSegments).

#include <cstddef>
#include <memory>
#include <string>

#include "transport/status.h"
#include "transport/store/store.h"
#include "transport/types.h"

namespace ddp::transport::shm {

/// Removes the segment names in `dir` ("ddp-<pid>-<number>-<deadline>",
/// this user's) that are at least `stale_after_s` seconds old (10 minutes
/// by default), a minute past the set-up deadline they carry (a name of an
/// older version, without one: no such condition), and whose creator is
/// gone: no process has its pid, the process that has it is a zombie, or
/// it started after the name was last modified (the pid was reused).
/// Returns how many. Rank 0 of a group calls it before creating a segment.
int RemoveStaleSegments(const std::string& dir = "/dev/shm", long stale_after_s = 600);

class Segment {
 public:
  /// Collective over the `group_size` ranks of the group (keys under
  /// `key_prefix`): creates (group_rank 0) or maps a segment of `bytes`.
  /// When any rank cannot create, open or map it, every rank returns the
  /// same UNAVAILABLE naming that rank and the cause, at once (the group
  /// then goes without it); other errors (the store's, a deadline) are
  /// this rank's alone.
  static StatusOr<std::unique_ptr<Segment>> CreateShared(store::Store& store,
                                                         const std::string& key_prefix,
                                                         int group_rank, int group_size,
                                                         size_t bytes, Deadline deadline);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  Segment(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data_;
  size_t bytes_;
};

}  // namespace ddp::transport::shm

#endif  // DDP_TRANSPORT_SHM_SEGMENT_H_
