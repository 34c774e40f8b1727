#include "transport/algorithms/reduce_scatter.h"

#include <limits>

#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/ring.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {

Status RingReduceScatter(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const int p = p2p.size(), r = p2p.rank();
  if (args.count > std::numeric_limits<size_t>::max() / p) {
    return InvalidArgumentError("ring reduce-scatter: count " + std::to_string(args.count) +
                                " times " + std::to_string(p) + " ranks overflows");
  }
  // Before the layout, which reads it.
  DDP_RETURN_IF_ERROR(internal::CheckBlockOwner("ring reduce-scatter", p2p, args));
  const size_t es = DataTypeSize(args.dtype);
  internal::BufferShape shape;
  shape.send_elems = args.count * p;
  shape.recv_elems = args.count;
  shape.uses_op = true;
  const internal::BlockLayout layout{args.count * p, p, args.tuning.block_owner};
  shape.recv_alias_offset = static_cast<int64_t>(layout.offset(r) * es);
  DDP_RETURN_IF_ERROR(internal::CheckArgs("ring reduce-scatter", p2p, args, shape));
  const internal::Fingerprint fingerprint =
      internal::MakeFingerprint(args, internal::kReduceScatterKind, /*uses_op=*/true, /*uses_root=*/false);
  if (args.count == 0) {
    return internal::CheckEmptyCall(p2p, args.deadline, "ring reduce-scatter", fingerprint,
                                    {{PhaseTag(args.tag, 0), internal::OtherRanks(p2p)}},
                                    args.call_id);
  }

  internal::RingParams params;
  params.dtype = args.dtype;
  params.op = args.op;
  params.tag = PhaseTag(args.tag, 0);
  params.deadline = args.deadline;
  params.call_id = args.call_id;
  params.fingerprint = &fingerprint;
  params.chunk_elems = internal::ChunkElems(args, internal::kRingChunkBytes);
  params.depth = internal::PipelineDepth(args, internal::kRingDepth);
  params.what = "ring reduce-scatter";
  DDP_RETURN_IF_ERROR(internal::RingReduceScatterBlocks(
      p2p, args.send, args.recv, layout, params));
  if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, args.recv, args.count, p);
  return Status();
}

}  // namespace ddp::transport::algorithms
