#include "transport/algorithms/all_gather.h"

#include <cstring>
#include <limits>

#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/ring.h"

namespace ddp::transport::algorithms {

Status RingAllGather(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const int p = p2p.size(), r = p2p.rank();
  if (args.count > std::numeric_limits<size_t>::max() / p) {
    return InvalidArgumentError("ring all-gather: count " + std::to_string(args.count) +
                                " times " + std::to_string(p) + " ranks overflows");
  }
  internal::BufferShape shape;
  shape.send_elems = args.count;
  shape.recv_elems = args.count * p;
  shape.recv_alias_offset = -2;
  DDP_RETURN_IF_ERROR(internal::CheckArgs("ring all-gather", p2p, args, shape));
  DDP_RETURN_IF_ERROR(internal::CheckBlockOwner("ring all-gather", p2p, args));
  const internal::Fingerprint fingerprint =
      internal::MakeFingerprint(args, internal::kAllGatherKind, /*uses_op=*/false, /*uses_root=*/false);
  if (args.count == 0) {
    return internal::CheckEmptyCall(p2p, args.deadline, "ring all-gather", fingerprint,
                                    {{PhaseTag(args.tag, 0), internal::OtherRanks(p2p)}},
                                    args.call_id);
  }

  const size_t es = DataTypeSize(args.dtype);
  const internal::BlockLayout layout{args.count * p, p, args.tuning.block_owner};
  auto* own = static_cast<unsigned char*>(args.recv) + layout.offset(r) * es;
  if (own != args.send) std::memmove(own, args.send, args.count * es);

  internal::RingParams params;
  params.dtype = args.dtype;
  params.tag = PhaseTag(args.tag, 0);
  params.deadline = args.deadline;
  params.call_id = args.call_id;
  params.fingerprint = &fingerprint;
  params.chunk_elems = internal::ChunkElems(args, internal::kRingChunkBytes);
  params.depth = internal::PipelineDepth(args, internal::kRingDepth);
  params.what = "ring all-gather";
  return internal::RingAllGatherBlocks(p2p, args.recv, layout, params);
}

}  // namespace ddp::transport::algorithms
