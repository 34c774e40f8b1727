#include "transport/p2p/group_view.h"

#include <string>

namespace ddp::transport::p2p {

StatusOr<GroupView> GroupView::Create(PointToPoint& parent, std::vector<int> members,
                                      Tag tag_offset) {
  if (members.empty()) return InvalidArgumentError("group view: members list is empty");
  if (tag_offset > kMaxTag) {
    return InvalidArgumentError("group view: tag offset " + std::to_string(tag_offset) +
                                " does not fit in " + std::to_string(kTagBits) + " bits");
  }
  std::vector<bool> seen(parent.size(), false);
  int self = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    if (m < 0 || m >= parent.size()) {
      return InvalidArgumentError("group view: member " + std::to_string(i) + " is rank " +
                                  std::to_string(m) + ", outside the parent's [0, " +
                                  std::to_string(parent.size()) + ")");
    }
    if (seen[m]) {
      return InvalidArgumentError("group view: rank " + std::to_string(m) +
                                  " is listed twice in the members");
    }
    seen[m] = true;
    if (m == parent.rank()) self = static_cast<int>(i);
  }
  if (self < 0) {
    return InvalidArgumentError("group view: the calling rank " + std::to_string(parent.rank()) +
                                " is not among the members");
  }
  return GroupView(&parent, std::move(members), tag_offset, self);
}

StatusOr<Tag> GroupView::MapTag(Tag tag) const {
  if (tag > kMaxTag - tag_offset_) {
    return InvalidArgumentError("group view: tag " + std::to_string(tag) + " plus offset " +
                                std::to_string(tag_offset_) + " does not fit in " +
                                std::to_string(kTagBits) + " bits");
  }
  return tag + tag_offset_;
}

Status GroupView::CheckPeer(int peer) const {
  if (peer < 0 || peer >= size()) {
    return InvalidArgumentError("group view: peer " + std::to_string(peer) +
                                " is outside the group's [0, " + std::to_string(size()) + ")");
  }
  return Status();
}

StatusOr<RequestId> GroupView::PostSend(int peer, Tag tag, const void* data, size_t bytes) {
  DDP_RETURN_IF_ERROR(CheckPeer(peer));
  DDP_ASSIGN_OR_RETURN(const Tag mapped, MapTag(tag));
  return parent_->PostSend(members_[peer], mapped, data, bytes);
}

StatusOr<RequestId> GroupView::PostRecv(int peer, Tag tag, void* data, size_t bytes) {
  DDP_RETURN_IF_ERROR(CheckPeer(peer));
  DDP_ASSIGN_OR_RETURN(const Tag mapped, MapTag(tag));
  return parent_->PostRecv(members_[peer], mapped, data, bytes);
}

Status GroupView::PostNotice(int peer, Tag tag, const void* data, size_t bytes) {
  DDP_RETURN_IF_ERROR(CheckPeer(peer));
  DDP_ASSIGN_OR_RETURN(const Tag mapped, MapTag(tag));
  return parent_->PostNotice(members_[peer], mapped, data, bytes);
}

}  // namespace ddp::transport::p2p
