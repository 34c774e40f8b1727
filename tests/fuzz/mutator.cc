#include "tests/fuzz/mutator.h"

#include <algorithm>
#include <utility>

namespace ddp::fuzz {
namespace {

// Values at the edges of integer ranges, where length and offset checks go
// wrong: zero, one, sign boundaries, all ones.
constexpr uint64_t kInteresting[] = {
    0,          1,          2,          0x7f,       0x80,       0xff,
    0x100,      0x7fff,     0x8000,     0xffff,     0x10000,    0x7fffffff,
    0x80000000, 0xffffffff, 0x100000000, 0x7fffffffffffffff, 0x8000000000000000,
    0xffffffffffffffff,
};

}  // namespace

uint64_t Rng::Next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t HashName(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

Mutator::Mutator(std::vector<std::string> corpus, uint64_t seed, size_t max_size)
    : corpus_(std::move(corpus)), rng_(seed), max_size_(max_size) {
  if (corpus_.empty()) corpus_.push_back(std::string());
}

std::string Mutator::Next() {
  std::string s = corpus_[turn_++ % corpus_.size()];
  const int edits = 1 + static_cast<int>(rng_.Below(8));
  for (int i = 0; i < edits; ++i) MutateOnce(s);
  if (s.size() > max_size_) s.resize(max_size_);
  return s;
}

void Mutator::MutateOnce(std::string& s) {
  const auto pos = [&](size_t size) { return size == 0 ? 0 : rng_.Below(size); };
  switch (rng_.Below(10)) {
    case 0: {  // flip one bit
      if (s.empty()) break;
      s[pos(s.size())] ^= static_cast<char>(1u << rng_.Below(8));
      break;
    }
    case 1: {  // random byte
      if (s.empty()) break;
      s[pos(s.size())] = static_cast<char>(rng_.Below(256));
      break;
    }
    case 2:    // boundary value in a field of 1, 2, 4 or 8 bytes, either order
    case 3: {
      const size_t width = size_t{1} << rng_.Below(4);
      if (s.size() < width) break;
      const size_t at = rng_.Below(s.size() - width + 1);
      uint64_t v = kInteresting[rng_.Below(std::size(kInteresting))];
      if (rng_.Below(4) == 0) v += rng_.Below(5) - 2;  // off by one or two
      const bool big_endian = rng_.Below(2) == 0;
      for (size_t i = 0; i < width; ++i) {
        const size_t shift = 8 * (big_endian ? width - 1 - i : i);
        s[at + i] = static_cast<char>((v >> shift) & 0xff);
      }
      break;
    }
    case 4: {  // insert random bytes
      const size_t n = 1 + rng_.Below(16);
      std::string bytes(n, '\0');
      for (char& c : bytes) c = static_cast<char>(rng_.Below(256));
      s.insert(pos(s.size() + 1), bytes);
      break;
    }
    case 5: {  // remove a range
      if (s.empty()) break;
      const size_t at = pos(s.size());
      s.erase(at, 1 + rng_.Below(std::min<size_t>(s.size() - at, 64)));
      break;
    }
    case 6: {  // duplicate a range somewhere else
      if (s.empty()) break;
      const size_t at = pos(s.size());
      const std::string piece = s.substr(at, 1 + rng_.Below(std::min<size_t>(s.size() - at, 64)));
      s.insert(pos(s.size() + 1), piece);
      break;
    }
    case 7: {  // truncate
      if (s.empty()) break;
      s.resize(pos(s.size()));
      break;
    }
    case 8: {  // splice: a prefix of this one and a suffix of another entry
      const std::string& other = corpus_[rng_.Below(corpus_.size())];
      const size_t cut = pos(s.size() + 1);
      const size_t from = pos(other.size() + 1);
      s = s.substr(0, cut) + other.substr(from);
      break;
    }
    case 9: {  // copy bytes over themselves (a field overwritten by a neighbour)
      if (s.size() < 2) break;
      const size_t from = pos(s.size());
      const size_t to = pos(s.size());
      const size_t n = 1 + rng_.Below(std::min<size_t>(s.size() - std::max(from, to), 16));
      std::string piece = s.substr(from, n);
      s.replace(to, n, piece);
      break;
    }
  }
}

}  // namespace ddp::fuzz
