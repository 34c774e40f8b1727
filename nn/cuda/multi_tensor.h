// Multi-tensor launches (PyTorch's multi_tensor_apply): one kernel launch
// works on many tensors, instead of one launch per tensor. Shapes: tensor k
// has kDepth operands (say p, grad, momentum buffer) of numel_k elements
// each, contiguous; it is cut into chunks of kMultiTensorChunk elements (the
// last one shorter), and block b of a launch handles chunk
// table.block_chunk[b] of tensor table.block_tensor[b].
//
// The table travels by value as the kernel's argument, so a launch needs no
// device memory and no host-to-device copy; it is sized to stay within the
// 4 KiB of a classic kernel parameter list with room for the kernel's other
// arguments. ResNet-50's 161 parameters (25.6 M elements) take 4 launches
// of SGD with momentum instead of 161.
//
// Host-only code shared by the .cu kernels and the host tests.
#pragma once

#include <cstdint>

#include "nn/cuda/launch.h"

namespace ddp::nn::cuda::launch {

/// Elements one block handles in one tensor.
inline constexpr int64_t kMultiTensorChunk = 65536;
/// Blocks (chunks) one launch handles at most.
inline constexpr int kMultiTensorMaxBlocks = 320;

/// Tensors one table holds at most, by operands per tensor (PyTorch's numbers).
constexpr int MultiTensorMaxTensors(int depth) { return depth == 1 ? 110 : depth == 2 ? 64 : 48; }

/// The kernel argument of a multi-tensor launch.
template <int kDepth>
struct MultiTensorTable {
  static_assert(kDepth >= 1 && kDepth <= kMultiTensorMaxOperands);
  static constexpr int kMaxTensors = MultiTensorMaxTensors(kDepth);
  void* ptrs[kDepth][kMaxTensors];
  int64_t numels[kMaxTensors];
  uint8_t block_tensor[kMultiTensorMaxBlocks];  ///< Index into ptrs and numels.
  int32_t block_chunk[kMultiTensorMaxBlocks];   ///< The chunk of that tensor.
};
// 4 KiB less what the kernels pass besides the table (SgdCoefficients: 48 bytes).
static_assert(sizeof(MultiTensorTable<1>) <= 3584 && sizeof(MultiTensorTable<2>) <= 3584 &&
              sizeof(MultiTensorTable<3>) <= 3584);
static_assert(MultiTensorMaxTensors(1) <= 256, "block_tensor is a uint8_t");

/// Packs `tensors[0, count)` in order into tables, taking operands
/// [0, kDepth) of each and skipping empty tensors, and calls
/// launch(const MultiTensorTable<kDepth>&, int blocks) -> cudaError_t for
/// each table, a table being full when it holds kMultiTensorMaxBlocks
/// chunks or kMaxTensors whole tensors. A tensor whose chunks do not fit
/// continues as the first tensor of the next table. Returns the first
/// error a launch returns (and launches nothing more), else cudaSuccess.
template <int kDepth, typename Launch>
cudaError_t ForEachMultiTensorTable(const MultiTensorEntry* tensors, int64_t count, Launch&& launch) {
  using Table = MultiTensorTable<kDepth>;
  Table table{};  // unused entries travel to the device too: zero, not garbage
  int num_tensors = 0, num_blocks = 0;
  for (int64_t k = 0; k < count; ++k) {
    const MultiTensorEntry& t = tensors[k];
    if (t.numel <= 0) continue;
    for (int d = 0; d < kDepth; ++d) table.ptrs[d][num_tensors] = t.operands[d];
    table.numels[num_tensors] = t.numel;
    ++num_tensors;
    const int64_t chunks = (t.numel + kMultiTensorChunk - 1) / kMultiTensorChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[num_blocks] = static_cast<uint8_t>(num_tensors - 1);
      table.block_chunk[num_blocks] = static_cast<int32_t>(c);
      ++num_blocks;
      const bool last_chunk = c == chunks - 1;
      if (num_blocks < kMultiTensorMaxBlocks && !(last_chunk && num_tensors == Table::kMaxTensors)) continue;
      const cudaError_t err = launch(static_cast<const Table&>(table), num_blocks);
      if (err != cudaSuccess) return err;
      num_blocks = 0;
      num_tensors = 0;
      if (!last_chunk) {  // the rest of tensor k goes on as tensor 0
        for (int d = 0; d < kDepth; ++d) table.ptrs[d][0] = t.operands[d];
        table.numels[0] = t.numel;
        num_tensors = 1;
      }
    }
  }
  return num_blocks > 0 ? launch(static_cast<const Table&>(table), num_blocks) : cudaSuccess;
}

}  // namespace ddp::nn::cuda::launch
