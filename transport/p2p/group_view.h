#ifndef DDP_TRANSPORT_P2P_GROUP_VIEW_H_
#define DDP_TRANSPORT_P2P_GROUP_VIEW_H_

// A PointToPoint over a subset of another one's ranks, so that a collective
// can run inside a sub-group (the ranks of one host, or one rank per host)
// without knowing it: group rank i is parent rank members[i], and group tag
// t is parent tag t + tag_offset, which keeps concurrent sub-groups' messages
// apart.
//
// Request handles are the parent's; Test/Wait/Cancel/CancelAll pass straight
// through, and notices are the parent's, with the peer and tag mapped.
// Error messages come from the parent and so name parent ranks.

#include <memory>
#include <span>
#include <vector>

#include "transport/p2p/point_to_point.h"
#include "transport/status.h"

namespace ddp::transport::p2p {

class GroupView final : public PointToPoint {
 public:
  /// A view of `parent` restricted to `members` (distinct parent ranks, in
  /// group-rank order). The calling rank must be a member. INVALID_ARGUMENT
  /// names the offending member, or the offset that leaves no tag room.
  static StatusOr<GroupView> Create(PointToPoint& parent, std::vector<int> members,
                                    Tag tag_offset = 0);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }

  /// The parent rank of group rank `group_rank`.
  int ParentRank(int group_rank) const { return members_[group_rank]; }
  /// The parent this view forwards to.
  PointToPoint& parent() const { return *parent_; }

  StatusOr<RequestId> PostSend(int peer, Tag tag, const void* data, size_t bytes) override;
  StatusOr<RequestId> PostRecv(int peer, Tag tag, void* data, size_t bytes) override;
  Status PostNotice(int peer, Tag tag, const void* data, size_t bytes) override;
  StatusOr<bool> Test(RequestId request) override { return parent_->Test(request); }
  Status WaitAll(std::span<const RequestId> requests, Deadline deadline) override {
    return parent_->WaitAll(requests, deadline);
  }
  StatusOr<size_t> WaitAny(std::span<const RequestId> requests, Deadline deadline) override {
    return parent_->WaitAny(requests, deadline);
  }
  void MarkWatched(RequestId request) override { parent_->MarkWatched(request); }
  void Cancel(RequestId request) override { parent_->Cancel(request); }
  void CancelAll(std::span<const RequestId> requests) override { parent_->CancelAll(requests); }
  uint64_t UnconfirmedReleases() const override { return parent_->UnconfirmedReleases(); }

 private:
  GroupView(PointToPoint* parent, std::vector<int> members, Tag tag_offset, int rank)
      : parent_(parent), members_(std::move(members)), tag_offset_(tag_offset), rank_(rank) {}

  StatusOr<Tag> MapTag(Tag tag) const;
  Status CheckPeer(int peer) const;

  PointToPoint* parent_;  // not owned; must outlive the view
  std::vector<int> members_;
  Tag tag_offset_;
  int rank_;
};

}  // namespace ddp::transport::p2p

#endif  // DDP_TRANSPORT_P2P_GROUP_VIEW_H_
