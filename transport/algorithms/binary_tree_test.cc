#include "transport/algorithms/binary_tree.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "gtest/gtest.h"

namespace ddp::transport::algorithms::internal {
namespace {

// Checks that `nodes` (one per rank) form one tree: parent and child links
// agree, at most `max_children` children, one root, every rank reachable
// from it. Returns the depth (edges on the longest root-to-leaf path).
int CheckTree(const std::vector<TreeNode>& nodes, const char* what, size_t max_children = 2) {
  const int p = static_cast<int>(nodes.size());
  int root = -1;
  for (int r = 0; r < p; ++r) {
    EXPECT_LE(nodes[r].children.size(), max_children) << what << " p=" << p << " rank " << r;
    if (nodes[r].parent < 0) {
      EXPECT_EQ(root, -1) << what << " p=" << p << ": two roots";
      root = r;
    } else {
      const auto& siblings = nodes[nodes[r].parent].children;
      EXPECT_NE(std::find(siblings.begin(), siblings.end(), r), siblings.end())
          << what << " p=" << p << ": rank " << r << " missing from its parent's children";
    }
    for (int c : nodes[r].children) EXPECT_EQ(nodes[c].parent, r) << what << " p=" << p;
  }
  EXPECT_GE(root, 0) << what << " p=" << p;
  int seen = 0, depth = 0;
  std::function<void(int, int)> walk = [&](int r, int d) {
    ++seen;
    depth = std::max(depth, d);
    for (int c : nodes[r].children) walk(c, d + 1);
  };
  if (root >= 0) walk(root, 0);
  EXPECT_EQ(seen, p) << what << " p=" << p << ": not every rank is reachable";
  return depth;
}

TEST(BinaryTreeTest, DoubleBinaryTreesAreTreesOfLogDepthWithComplementaryLeaves) {
  for (int p = 1; p <= 64; ++p) {
    std::vector<TreeNode> t0(p), t1(p);
    for (int r = 0; r < p; ++r) {
      auto both = DoubleBinaryTree(p, r);
      t0[r] = both[0];
      t1[r] = both[1];
    }
    int log = 0;
    while ((1 << log) < p + 1) ++log;
    EXPECT_LE(CheckTree(t0, "tree 0"), log) << "p=" << p;
    EXPECT_LE(CheckTree(t1, "tree 1"), log) << "p=" << p;
    // Ranks that are leaves in both trees do no forwarding at all; the
    // construction keeps that to at most one rank.
    int leaves_in_both = 0;
    for (int r = 0; r < p; ++r) {
      leaves_in_both += t0[r].children.empty() && t1[r].children.empty();
    }
    EXPECT_LE(leaves_in_both, 1) << "p=" << p;
    // Tree 0's leaves are exactly the even ranks (odd positions).
    for (int r = 0; r < p; ++r) EXPECT_EQ(t0[r].children.empty(), r % 2 == 0) << "p=" << p;
  }
}

TEST(BinaryTreeTest, InOrderTreeOfSevenIsTheCompleteTree) {
  // Positions 1..7: root 4, children 2 and 6, leaves 1, 3, 5, 7.
  EXPECT_EQ(InOrderTree(7, 3).parent, -1);
  EXPECT_EQ(InOrderTree(7, 3).children, (std::vector<int>{1, 5}));
  EXPECT_EQ(InOrderTree(7, 1).children, (std::vector<int>{0, 2}));
  EXPECT_EQ(InOrderTree(7, 6).parent, 5);
  // With 5 ranks, position 5's natural parent 6 is missing: it hangs from 4.
  EXPECT_EQ(InOrderTree(5, 4).parent, 3);
}

TEST(BinaryTreeTest, BroadcastShapesFromEveryRoot) {
  for (int p = 1; p <= 17; ++p) {
    for (int root = 0; root < p; ++root) {
      std::vector<TreeNode> heap(p), chain(p);
      for (int r = 0; r < p; ++r) {
        heap[r] = HeapTree(p, root, r);
        chain[r] = ChainTree(p, root, r);
      }
      CheckTree(heap, "heap");
      EXPECT_EQ(CheckTree(chain, "chain"), p - 1);
      EXPECT_EQ(heap[root].parent, -1);
      EXPECT_EQ(chain[root].parent, -1);
    }
  }
}

TEST(BinaryTreeTest, BinomialTreesHaveLogDepthFromEveryRoot) {
  for (int p = 1; p <= 17; ++p) {
    int log2p = 0;  // ceil(log2 p)
    while ((1 << log2p) < p) ++log2p;
    for (int root = 0; root < p; ++root) {
      std::vector<TreeNode> nodes(p);
      for (int r = 0; r < p; ++r) nodes[r] = BinomialTree(p, root, r);
      // Depth: the most set bits of any v < p (log2 p for powers of two).
      const int depth = CheckTree(nodes, "binomial", static_cast<size_t>(log2p));
      EXPECT_LE(depth, log2p) << "p=" << p << " root=" << root;
      if ((p & (p - 1)) == 0) {
        EXPECT_EQ(depth, log2p) << "p=" << p;
      }
      EXPECT_EQ(nodes[root].parent, -1);
      EXPECT_EQ(static_cast<int>(nodes[root].children.size()), log2p) << "p=" << p;
    }
  }
  // Six ranks, root 2 (relabelled 0..5 as ranks 2,3,4,5,0,1): 0 <- {1,2,4},
  // 2 <- {3}, 4 <- {5}.
  EXPECT_EQ(BinomialTree(6, 2, 2).children, (std::vector<int>{3, 4, 0}));
  EXPECT_EQ(BinomialTree(6, 2, 4).children, (std::vector<int>{5}));
  EXPECT_EQ(BinomialTree(6, 2, 0).children, (std::vector<int>{1}));
  EXPECT_EQ(BinomialTree(6, 2, 1).parent, 0);
  EXPECT_TRUE(BinomialTree(6, 2, 3).children.empty());
}

}  // namespace
}  // namespace ddp::transport::algorithms::internal
