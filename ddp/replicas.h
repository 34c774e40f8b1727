#ifndef DDP_DDP_REPLICAS_H_
#define DDP_DDP_REPLICAS_H_

// Keeping model replicas identical across ranks (private to //ddp): the
// construction-time check that every rank built the same model, and
// coalesced broadcasts of parameters and buffers.

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "ddp/process_group.h"
#include "nn/tensor/tensor.h"

namespace ddp::dist::internal {

/// One line of a rank's model description.
struct ReplicaEntry {
  std::string kind;   ///< "parameter", "buffer", "module" or "option".
  std::string name;   ///< "1.weight", "layer1.0.bn1", "bucket_cap_mb".
  std::string value;  ///< "f32 [512, 784] strides [784, 1]", "SyncBatchNorm", "25".
};

/// Numbers the GPUs of one rank's model in the order its tensors first name
/// them, for DescribeTensor. Ranks compare that order, not device indices:
/// one process per GPU puts rank r's replica on cuda:r (cuda#0 on every
/// rank), but the groups of GroupByDtypeAndDevice and the Reducer's buckets
/// are formed per device and paired across ranks by position, so a model
/// split over two GPUs on one rank and on one GPU on another must differ.
class GpuOrder {
 public:
  /// k for the k-th distinct GPU passed so far (this one included).
  int Of(nn::Device device);

 private:
  std::vector<int> indices_;  // device indices, in order of first appearance
};

/// "f32 [512, 784] strides [784, 1]" (plus " on cuda#k" for a tensor on the
/// k-th GPU of `gpus`, and " no-grad" for a parameter that does not require
/// grad). One `gpus` describes every tensor of a rank's model, in order.
std::string DescribeTensor(const nn::Tensor& t, bool is_parameter, GpuOrder& gpus);

/// Collective: returns when every rank passed the same entries; otherwise
/// throws std::invalid_argument, with the same message on every rank:
/// `heading` (who checked, and what must match: "DistributedDataParallel:
/// the ranks' models differ (...)."), then the first differing entry and
/// each rank's value of it. When they differ, rank 0's description is
/// broadcast and each rank compares its own with it; the ranks then share
/// fixed-size records (where each differs first, its entry there, which of
/// the first 64 distinct names there it has; the message counts the names
/// beyond those, which it does not check), so the memory does not grow with the number of
/// ranks beyond about 1.6 KB per rank. Every exchange has the same size on
/// every rank, so differing ranks cannot hang, and a rank that fails
/// between them (out of memory) aborts the group with the cause rather than
/// leaving the others waiting.
void VerifyReplicas(ProcessGroup& pg, const std::vector<ReplicaEntry>& entries, const std::string& heading);

/// Makes VerifyReplicas look for the absence on other ranks of at most
/// `most` distinct names at the first difference (at most 64, its bound;
/// 0 restores it), so that a test of a few ranks reaches the names beyond
/// the bound, which the message counts. Process-wide; for tests.
void SetNamesCheckedForTesting(size_t most);

/// VerifyReplicas' message for ranks whose entries differ (`ranks[r]` is
/// rank r's): `heading`, the first differing entry of the first kind that
/// differs ("parameter", then "option", "buffer", "module") with each rank's
/// value, each rank's count of that kind when the counts differ, and, for
/// each name at that position that some ranks lack altogether, one
/// sentence naming all of them.
std::string ExplainReplicaDifference(const std::vector<std::vector<ReplicaEntry>>& ranks,
                                     const std::string& heading);

/// Indices of the tensors with elements, one group per dtype and device
/// (type and index), the groups in the order of their first tensor in
/// `tensors`: BroadcastCoalesced's groups. In that order, not by device
/// index, because ranks pair the groups by position and a model may sit on
/// different GPU indices on different ranks (VerifyReplicas compares GPUs by
/// their GpuOrder, not their index): rank 0's cuda:0 part and rank 1's
/// cuda:3 part must both come first.
std::vector<std::vector<size_t>> GroupByDtypeAndDevice(const std::vector<nn::Tensor>& tensors);

/// How many of `text`'s first `most` bytes to keep so that the kept text
/// ends on a UTF-8 character boundary: the text's length where it is
/// shorter, else `most` less the bytes of a character it would cut (at
/// most 3). Allocates nothing: for "%.*s" in the fixed buffers of abort
/// reasons, which go to every rank's stderr and error files.
int Utf8PrefixBytes(const char* text, int most) noexcept;

/// PyTorch's broadcast bucket size for the initial and buffer broadcasts.
inline constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;

/// Collective: copies rank `root`'s values of `tensors` into every rank's,
/// per dtype and device one broadcast per bucket of consecutive tensors of
/// at most `bucket_bytes` (through a flat buffer, except for a bucket of one
/// contiguous tensor, which is broadcast in place; a tensor larger than
/// `bucket_bytes` is a bucket of its own). The temporary memory is thus at
/// most `bucket_bytes`, or one non-contiguous tensor, whatever the model's
/// size. Every rank must pass tensors of the same dtypes, devices and sizes.
/// Where a rank fails decides whether the group is aborted, not the
/// exception's type: a refusal by the checks every rank runs alike before
/// the first exchange (bucket_bytes 0; a device with no backend, "device
/// cuda:0 is not available") is thrown on every rank and leaves the group
/// usable. A failure from the first bucket on (no memory for a bucket's
/// flat buffer, a copy refused on one rank), or out of memory anywhere,
/// may be this rank's alone: it aborts the group with "broadcasting the
/// <label> failed on rank N: <what()>" (label and what() cut on a UTF-8
/// character boundary), so that the others fail at once instead of at
/// the group's timeout, and rethrows.
void BroadcastCoalesced(ProcessGroup& pg, const std::vector<nn::Tensor>& tensors, int root,
                        const std::string& label, size_t bucket_bytes = kBroadcastBucketBytes);

/// Test only: BroadcastCoalesced calls `fault(bucket)` (0, 1, ... across
/// its groups) before each bucket's exchange, where a throw stands for
/// this rank failing alone; empty to stop. Not synchronised: set it while
/// no BroadcastCoalesced runs.
void SetBucketFaultForTesting(std::function<void(int bucket)> fault);

}  // namespace ddp::dist::internal

#endif  // DDP_DDP_REPLICAS_H_
