#include "transport/algorithms/binary_tree.h"

namespace ddp::transport::algorithms::internal {
namespace {

// Largest power of two <= p (p >= 1): the root's position.
int TopBit(int p) {
  int b = 1;
  while (b * 2 <= p) b *= 2;
  return b;
}

// Parent position of position x in [1, p], or 0 for the root.
int ParentPosition(int x, int p) {
  const int top = TopBit(p);
  int y = x;
  while (true) {
    const int b = y & -y;
    if (b >= top) return 0;  // only the root has the top level
    y = (y - b) | (b << 1);
    if (y <= p) return y;
  }
}

}  // namespace

TreeNode InOrderTree(int p, int rank) {
  TreeNode node;
  const int x = rank + 1;
  const int parent = ParentPosition(x, p);
  node.parent = parent == 0 ? -1 : parent - 1;
  // Children are the positions whose parent is x; only positions inside x's
  // natural subtree (x - b, x + b) can qualify.
  const int b = x & -x;
  for (int y = x - b + 1; y < x + b && y <= p; ++y) {
    if (y != x && ParentPosition(y, p) == x) node.children.push_back(y - 1);
  }
  return node;
}

std::array<TreeNode, 2> DoubleBinaryTree(int p, int rank) {
  std::array<TreeNode, 2> trees;
  trees[0] = InOrderTree(p, rank);
  // Tree 1 is tree 0 with ranks renamed by `map` (an involution when
  // mirroring; a rotation, with its inverse `unmap`, when shifting).
  auto map = [p](int r) { return p % 2 == 0 ? p - 1 - r : (r + p - 1) % p; };
  auto unmap = [p](int r) { return p % 2 == 0 ? p - 1 - r : (r + 1) % p; };
  const TreeNode image = InOrderTree(p, map(rank));
  trees[1].parent = image.parent < 0 ? -1 : unmap(image.parent);
  for (int c : image.children) trees[1].children.push_back(unmap(c));
  if (trees[1].children.size() == 2 && trees[1].children[0] > trees[1].children[1]) {
    std::swap(trees[1].children[0], trees[1].children[1]);
  }
  return trees;
}

TreeNode HeapTree(int p, int root, int rank) {
  TreeNode node;
  const int v = (rank - root + p) % p;
  if (v > 0) node.parent = ((v - 1) / 2 + root) % p;
  for (int c : {2 * v + 1, 2 * v + 2}) {
    if (c < p) node.children.push_back((c + root) % p);
  }
  return node;
}

TreeNode ChainTree(int p, int root, int rank) {
  TreeNode node;
  const int v = (rank - root + p) % p;
  if (v > 0) node.parent = (v - 1 + root) % p;
  if (v + 1 < p) node.children.push_back((v + 1 + root) % p);
  return node;
}

TreeNode BinomialTree(int p, int root, int rank) {
  TreeNode node;
  const int v = (rank - root + p) % p;
  const int low = v & -v;  // 0 at the root
  if (v > 0) node.parent = (v - low + root) % p;
  for (int bit = 1; bit < p && (v == 0 || bit < low); bit <<= 1) {
    if (v + bit < p) node.children.push_back((v + bit + root) % p);
  }
  return node;
}

}  // namespace ddp::transport::algorithms::internal
