#include "transport/algorithms/ring_all_reduce.h"

#include "transport/algorithms/pipeline.h"
#include "transport/algorithms/ring.h"
#include "transport/reduce/reduce.h"

namespace ddp::transport::algorithms {

Status RingAllReduce(p2p::PointToPoint& p2p, const CollectiveArgs& args) {
  const internal::CollectiveStart start = internal::StartFlatAllReduce(p2p, args, internal::kRingAllReduceKind);
  if (start.finished) return start.status;
  const internal::Fingerprint& fingerprint = start.fingerprint;

  const int p = p2p.size(), r = p2p.rank();
  const size_t es = DataTypeSize(args.dtype);
  const internal::BlockLayout layout{args.count, p};
  internal::RingParams params;
  params.dtype = args.dtype;
  params.op = args.op;
  params.deadline = args.deadline;
  params.call_id = args.call_id;
  params.fingerprint = &fingerprint;
  params.chunk_elems = internal::ChunkElems(args, internal::kRingChunkBytes);
  params.depth = internal::PipelineDepth(args, internal::kRingDepth);

  auto* own = static_cast<unsigned char*>(args.recv) + layout.offset(r) * es;
  params.tag = PhaseTag(args.tag, 0);
  params.what = "ring all-reduce (reduce-scatter)";
  DDP_RETURN_IF_ERROR(
      internal::RingReduceScatterBlocks(p2p, args.send, own, layout, params));
  // Each rank divides only the block it owns, before it is shared: 1/p of
  // the division work, and every rank ends with identical bits.
  if (args.op == ReduceOp::kAvg) reduce::DivideInPlace(args.dtype, own, layout.size(r), p);
  params.tag = PhaseTag(args.tag, 1);
  params.what = "ring all-reduce (all-gather)";
  params.fingerprint = nullptr;  // checked in the reduce-scatter
  return internal::RingAllGatherBlocks(p2p, args.recv, layout, params);
}

}  // namespace ddp::transport::algorithms
