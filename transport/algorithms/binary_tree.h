#ifndef DDP_TRANSPORT_ALGORITHMS_BINARY_TREE_H_
#define DDP_TRANSPORT_ALGORITHMS_BINARY_TREE_H_

// The trees of the tree algorithms (private to this package).
//
// InOrderTree: ranks 0..p-1 are positions 1..p of an in-order binary tree:
// position x's level is the number of trailing zero bits of x, its natural
// parent is (x - b) | 2b with b = x & -x, and a parent beyond p is skipped
// (the node hangs from the nearest existing ancestor). Depth is
// ceil(log2(p + 1)) and every odd position is a leaf, so half the ranks are
// leaves.
//
// DoubleBinaryTree: two such trees over the same ranks, the second mirrored
// (p even) or shifted by one (p odd), so that a leaf of one tree is an inner
// node of the other (as in NCCL's double binary tree): with half the data on
// each tree, every rank sends and receives about as much as in a ring, with
// logarithmic depth.

#include <array>
#include <vector>

namespace ddp::transport::algorithms::internal {

/// One rank's place in a tree over ranks 0..p-1.
struct TreeNode {
  int parent = -1;              ///< -1 at the root
  /// Binary trees: at most two, ascending. Binomial: up to log2 p, the
  /// smallest subtree first.
  std::vector<int> children;
};

/// The node of `rank` in the in-order tree over p ranks.
TreeNode InOrderTree(int p, int rank);

/// The node of `rank` in tree 0 and tree 1 of the double binary tree.
std::array<TreeNode, 2> DoubleBinaryTree(int p, int rank);

/// Pipelined broadcast shapes, over ranks relabelled so that the root is 0:
/// a binary heap (log depth, each node sends twice) or a chain (depth p - 1,
/// each node sends once: the bandwidth-optimal shape for long messages).
TreeNode HeapTree(int p, int root, int rank);
TreeNode ChainTree(int p, int root, int rank);

/// Binomial tree towards `root`, over ranks relabelled v = (rank - root)
/// mod p: v's parent is v without its lowest set bit, its children are
/// v + 2^k for each 2^k below that bit (every k at the root) while below p.
/// Depth ceil(log2 p) for any p; the subtree of child v + 2^k holds 2^k
/// ranks at most, so the first children finish first (reduce to a root).
TreeNode BinomialTree(int p, int root, int rank);

}  // namespace ddp::transport::algorithms::internal

#endif  // DDP_TRANSPORT_ALGORITHMS_BINARY_TREE_H_
