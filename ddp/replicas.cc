#include "ddp/replicas.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <new>
#include <stdexcept>
#include <string_view>
#include <tuple>
#include <unordered_set>

#include "ddp/debug_mode.h"

namespace ddp::dist::internal {
namespace {

// A rank's description as one string: every field as its length in
// decimal, ':', then its bytes. Names are the user's (any byte, a
// separator included), so no byte can mark where a field ends: with 0x1f
// between fields and 0x1e between entries, a name holding either was
// parsed into other fields on the ranks that compared against rank 0's
// description, which then named the wrong entry as the first difference.
void PutField(const std::string& field, std::string& out) {
  out += std::to_string(field.size());
  out += ':';
  out += field;
}

std::string Serialize(const std::vector<ReplicaEntry>& entries) {
  std::string out;
  for (const ReplicaEntry& e : entries) {
    PutField(e.kind, out);
    PutField(e.name, out);
    PutField(e.value, out);
  }
  return out;
}

// The field at `pos` into `field`, `pos` moved past it; false when the text
// there is not a field.
bool GetField(const std::string& text, size_t& pos, std::string& field) {
  const size_t colon = text.find(':', pos);
  if (colon == std::string::npos || colon == pos || colon - pos > 19) return false;
  size_t length = 0;
  for (size_t i = pos; i < colon; ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
    length = length * 10 + static_cast<size_t>(text[i] - '0');
  }
  if (length > text.size() - colon - 1) return false;
  field = text.substr(colon + 1, length);
  pos = colon + 1 + length;
  return true;
}

std::vector<ReplicaEntry> Parse(const std::string& text) {
  std::vector<ReplicaEntry> entries;
  size_t pos = 0;
  while (pos < text.size()) {
    ReplicaEntry e;
    if (!GetField(text, pos, e.kind) || !GetField(text, pos, e.name) || !GetField(text, pos, e.value)) break;
    entries.push_back(std::move(e));
  }
  return entries;
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Entries of one kind, in order.
std::vector<const ReplicaEntry*> OfKind(const std::vector<ReplicaEntry>& all, const std::string& kind) {
  std::vector<const ReplicaEntry*> out;
  for (const ReplicaEntry& e : all) {
    if (e.kind == kind) out.push_back(&e);
  }
  return out;
}

std::string Plural(const std::string& kind, size_t n) {
  return std::to_string(n) + " " + kind + (n == 1 ? "" : "s");
}

// Bounds on what the mismatch message shows of one name or value, and on
// the groups of ranks it lists: it is thrown, and often logged, on every
// rank, and a value can be long (bucket_order lists every trainable
// parameter's index).
constexpr size_t kMostNameBytes = 1024;
constexpr size_t kMostValueBytes = 512;
constexpr size_t kMostGroups = 8;

// The length of the valid UTF-8 character that starts at `at` (2 to 4
// bytes), or 0 when none does there (no overlong form, surrogate or code
// point past U+10FFFF).
size_t Utf8Length(const std::string& text, size_t at) {
  const unsigned char c = static_cast<unsigned char>(text[at]);
  size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) {
    length = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    length = 3;
    if (c == 0xe0) low = 0xa0;
    if (c == 0xed) high = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    length = 4;
    if (c == 0xf0) low = 0x90;
    if (c == 0xf4) high = 0x8f;
  } else {
    return 0;
  }
  if (length > text.size() - at) return 0;
  for (size_t k = 1; k < length; ++k) {
    const unsigned char b = static_cast<unsigned char>(text[at + k]);
    if (k == 1 ? (b < low || b > high) : (b & 0xc0) != 0x80) return 0;
  }
  return length;
}

// `text` as valid UTF-8 without control bytes: a control byte, a byte that
// is not part of a valid UTF-8 character, and the backslash itself written
// as \xNN. The message is read through what(), which ends at a NUL;
// control bytes garble a log line or a terminal, and invalid UTF-8 breaks
// readers that expect text. With the backslash escaped too, every
// backslash of the result begins a 4-byte escape, which Cut relies on.
std::string Printable(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const unsigned char u = static_cast<unsigned char>(text[i]);
    if (u >= 0x20 && u < 0x7f && u != '\\') {
      out += text[i++];
      continue;
    }
    if (const size_t length = u >= 0x80 ? Utf8Length(text, i) : 0; length > 0) {
      out.append(text, i, length);
      i += length;
      continue;
    }
    constexpr char kHex[] = "0123456789abcdef";
    out += "\\x";
    out += kHex[u >> 4];
    out += kHex[u & 15];
    ++i;
  }
  return out;
}

// The most bytes a cut of Printable's output moves to reach a character's
// boundary: 3, inside a 4-byte UTF-8 character or a \xNN escape.
constexpr size_t kMostCutSteps = 3;

// Whether `at` falls inside a character of `text` (Printable's output):
// on a UTF-8 continuation byte, or after the backslash of a \xNN escape
// (every backslash there begins one). The start of a character that
// begins there, if it does not: where a cut may fall.
bool SplitsACharacter(const std::string& text, size_t at) {
  if (at == 0 || at >= text.size()) return false;
  if ((static_cast<unsigned char>(text[at]) & 0xc0) == 0x80) return true;
  for (size_t back = 1; back <= kMostCutSteps && back <= at; ++back) {
    if (text[at - back] == '\\') return true;
  }
  return false;
}

// `text` (Printable's output), or its start and end around "..." when
// longer than `most`, each cut on a character's boundary (a multi-byte
// UTF-8 character or a \xNN escape is kept whole or left out), so the
// message stays valid text. Each cut moves at most kMostCutSteps bytes,
// all a cut of Printable's output needs: a text that is not Printable's
// cannot make it walk further.
std::string Cut(const std::string& text, size_t most) {
  if (text.size() <= most) return text;
  const size_t tail = most / 4;
  size_t head_end = most - tail - 3;
  for (size_t step = 0; step < kMostCutSteps && SplitsACharacter(text, head_end); ++step) --head_end;
  size_t tail_start = text.size() - tail;
  for (size_t step = 0; step < kMostCutSteps && SplitsACharacter(text, tail_start); ++step) ++tail_start;
  return text.substr(0, head_end) + "..." + text.substr(tail_start);
}

// Ranks with the same text, in the order of their first rank.
struct RankGroup {
  std::string text;
  std::vector<int> ranks;
};

// Ranks grouped by key_of(r), whole (two long values that differ only
// where the message cuts them are two groups); each group shown as
// text_of(its first rank).
template <typename KeyOf, typename TextOf>
std::vector<RankGroup> GroupRanks(int size, KeyOf key_of, TextOf text_of) {
  std::vector<RankGroup> groups;
  std::map<std::string, size_t> place;
  for (int r = 0; r < size; ++r) {
    const auto [it, added] = place.try_emplace(key_of(r), groups.size());
    if (added) groups.push_back({text_of(r), {}});
    groups[it->second].ranks.push_back(r);
  }
  return groups;
}

// "ranks 0-1022 have X; rank 1023 has Y": at most kMostGroups groups, then
// how many more and their ranks.
std::string ListGroups(const std::vector<RankGroup>& groups, const char* has, const char* have) {
  std::string out;
  std::vector<int> rest;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i >= kMostGroups) {
      rest.insert(rest.end(), groups[i].ranks.begin(), groups[i].ranks.end());
      continue;
    }
    out += (i ? "; " : "") + RankSet(groups[i].ranks) + (groups[i].ranks.size() == 1 ? has : have) + groups[i].text;
  }
  if (!rest.empty()) {
    std::sort(rest.begin(), rest.end());
    out += "; and " + std::to_string(groups.size() - kMostGroups) + " more values on " + RankSet(rest);
  }
  return out;
}

// The parts of a DescribeTensor text: "f32 [8, 4] strides [4, 1] on cuda#0 no-grad".
struct TensorFields {
  std::string dtype, shape, strides, device = "cpu";
  bool no_grad = false;
};

TensorFields ParseTensorDescription(const std::string& v) {
  TensorFields f;
  f.dtype = v.substr(0, v.find(' '));
  const size_t open = v.find('['), close = open == std::string::npos ? open : v.find(']', open);
  if (close != std::string::npos) f.shape = v.substr(open, close - open + 1);
  const size_t strides = close == std::string::npos ? close : v.find(" strides [", close);
  const size_t strides_end = strides == std::string::npos ? strides : v.find(']', strides);
  if (strides_end != std::string::npos) f.strides = v.substr(strides, strides_end - strides + 1);
  const size_t on = v.find(" on ", strides_end == std::string::npos ? 0 : strides_end);
  if (on != std::string::npos) f.device = v.substr(on + 4, v.find(' ', on + 4) - (on + 4));
  const std::string_view suffix = " no-grad";
  f.no_grad = v.size() >= suffix.size() && v.compare(v.size() - suffix.size(), suffix.size(), suffix) == 0;
  return f;
}

// One rank's entry at the first difference, as the message needs it:
// hashes to compare whole names and values, and their cut forms to show.
struct EntryView {
  bool present = false;
  uint64_t name_hash = 0, value_hash = 0;
  std::string name, value;  // cut to kMostNameBytes, kMostValueBytes
  int64_t count = 0;        // the rank's entries of this kind
};

EntryView ViewOf(const std::vector<const ReplicaEntry*>& list, size_t k) {
  EntryView v;
  v.count = static_cast<int64_t>(list.size());
  if (k >= list.size()) return v;
  v.present = true;
  v.name_hash = Fnv1a(list[k]->name);
  v.value_hash = Fnv1a(list[k]->value);
  v.name = Cut(Printable(list[k]->name), kMostNameBytes);
  v.value = Cut(Printable(list[k]->value), kMostValueBytes);
  return v;
}

// Adds to `out` (once each) the properties in which `a` and `b` differ:
// "name", and for tensors "dtype", "shape", "strides", "device",
// "requires_grad" (or "value" when none of these differs); for an option
// its "value", for a module its "type".
void AddDifferences(const std::string& kind, const EntryView& a, const EntryView& b, std::vector<std::string>& out) {
  auto add = [&](bool differs, const char* property) {
    if (differs && std::find(out.begin(), out.end(), property) == out.end()) out.push_back(property);
  };
  add(a.name_hash != b.name_hash, "name");
  if (a.value_hash == b.value_hash) return;
  if (kind == "option") return add(true, "value");
  if (kind == "module") return add(true, "type");
  const TensorFields x = ParseTensorDescription(a.value), y = ParseTensorDescription(b.value);
  // A value that is not DescribeTensor's (ZeRO's "... in param group 1"),
  // or that differs past its cut, may differ in none of the fields.
  bool told = false;
  auto field = [&](bool differs, const char* property) {
    told = told || differs;
    add(differs, property);
  };
  field(x.dtype != y.dtype, "dtype");
  field(x.shape != y.shape, "shape");
  field(x.strides != y.strides, "strides");
  field(x.device != y.device, "device");
  field(x.no_grad != y.no_grad, "requires_grad");
  add(!told, "value");
}

// A name at the first difference that some ranks have nowhere among their
// entries of that kind.
struct Lacking {
  std::string name;  // cut
  std::vector<int> ranks;
};

// The message for a first difference at `kind` #k, from each rank's view
// of it; `lacking`: the names at #k some ranks lack (at most kMostGroups),
// `unsaid` how many more such names there are ("at least" when
// `unchecked`: how many distinct names at #k were not looked for on the
// other ranks at all).
std::string ExplainAt(const std::string& heading, const std::string& kind, size_t k,
                      const std::vector<EntryView>& views, const std::vector<Lacking>& lacking, size_t unsaid,
                      size_t unchecked) {
  const int size = static_cast<int>(views.size());
  auto missing = [&](int r) {
    return "no " + kind + " #" + std::to_string(k) + " (it has " + Plural(kind, views[r].count) + ")";
  };
  // The ranks with the same entry together (as a rule all ranks but a few
  // have the same), so that the message does not grow with the number of
  // ranks; grouped by the whole entry, not its cut form.
  std::vector<RankGroup> at_k = GroupRanks(
      size,
      [&](int r) {
        return views[r].present ? std::to_string(views[r].name_hash) + ':' + std::to_string(views[r].value_hash)
                                : missing(r);
      },
      [&](int r) { return views[r].present ? "`" + views[r].name + "` " + views[r].value : missing(r); });
  std::string m = heading + " First difference at " + kind + " #" + std::to_string(k) + ": " +
                  ListGroups(at_k, " has ", " have ") + ".";
  std::vector<std::string> properties;
  const EntryView& first = views[at_k[0].ranks[0]];
  for (const RankGroup& g : at_k) {
    const EntryView& other = views[g.ranks[0]];
    if (first.present && other.present) AddDifferences(kind, first, other, properties);
  }
  if (!properties.empty()) {
    m += " They differ in";
    for (size_t i = 0; i < properties.size(); ++i) m += (i ? ", " : " ") + properties[i];
    m += ".";
  }
  bool counts_differ = false;
  for (int r = 1; r < size; ++r) counts_differ = counts_differ || views[r].count != views[0].count;
  if (counts_differ) {
    auto count = [&](int r) { return Plural(kind, views[r].count); };
    m += " Counts: " + ListGroups(GroupRanks(size, count, count), " has ", " have ") + ".";
  }
  for (const Lacking& l : lacking) {
    std::string who = RankSet(l.ranks);
    who[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(who[0])));
    m += " " + who + (l.ranks.size() == 1 ? " has no " : " have no ") + kind + " named `" + l.name + "`.";
  }
  if (unsaid > 0) {
    m += " " + std::to_string(unsaid) + " more names at #" + std::to_string(k) + " are missing on some ranks.";
  }
  if (unchecked > 0) {
    m += " " + std::to_string(unchecked) + (unchecked == 1 ? " more distinct name" : " more distinct names") +
         " at #" + std::to_string(k) + (unchecked == 1 ? " was" : " were") +
         " not checked for ranks that lack it (too many ranks differ there to look for every name).";
  }
  return m;
}

const char* const kKinds[] = {"parameter", "option", "buffer", "module"};
constexpr int64_t kNoDifference = 4;  // past the last kind

// Where `mine` first differs from `reference` (rank 0's): the kind's index
// in kKinds and the position among entries of that kind; kNoDifference
// when it does not.
std::pair<int64_t, int64_t> FirstDifference(const std::vector<ReplicaEntry>& reference,
                                            const std::vector<ReplicaEntry>& mine) {
  for (int64_t kind = 0; kind < kNoDifference; ++kind) {
    const auto a = OfKind(reference, kKinds[kind]), b = OfKind(mine, kKinds[kind]);
    for (size_t k = 0; k < std::max(a.size(), b.size()); ++k) {
      if (k >= a.size() || k >= b.size() || a[k]->name != b[k]->name || a[k]->value != b[k]->value) {
        return {kind, static_cast<int64_t>(k)};
      }
    }
  }
  return {kNoDifference, 0};
}

}  // namespace

std::string ExplainReplicaDifference(const std::vector<std::vector<ReplicaEntry>>& ranks,
                                     const std::string& heading) {
  const int size = static_cast<int>(ranks.size());
  // The first difference of any rank from rank 0 (options before buffers:
  // a rank with broadcast_buffers off describes no buffers, and its
  // option, not the missing buffers, is the cause).
  std::pair<int64_t, int64_t> first{kNoDifference, 0};
  for (int r = 1; r < size; ++r) first = std::min(first, FirstDifference(ranks[0], ranks[r]));
  if (first.first == kNoDifference) return heading + " The difference could not be located.";
  const std::string kind = kKinds[first.first];
  const size_t k = static_cast<size_t>(first.second);
  std::vector<std::vector<const ReplicaEntry*>> lists;
  std::vector<EntryView> views;
  for (const auto& r : ranks) {
    lists.push_back(OfKind(r, kind));
    views.push_back(ViewOf(lists.back(), k));
  }
  // Name a missing entry outright: each distinct name at #k once, with
  // every rank that has no entry of that name anywhere. Each rank's names
  // go into a set once, so that thousands of entries on many ranks stay
  // linear in their number.
  std::vector<std::unordered_set<std::string_view>> names(size);
  for (int q = 0; q < size; ++q) {
    for (const ReplicaEntry* e : lists[q]) names[q].insert(e->name);
  }
  std::vector<std::string_view> said;
  std::vector<Lacking> lacking;
  size_t unsaid = 0;
  for (int r = 0; r < size; ++r) {
    if (k >= lists[r].size()) continue;
    const std::string_view name = lists[r][k]->name;
    if (std::find(said.begin(), said.end(), name) != said.end()) continue;
    said.push_back(name);
    Lacking l{Cut(Printable(std::string(name)), kMostNameBytes), {}};
    for (int q = 0; q < size; ++q) {
      if (names[q].count(name) == 0) l.ranks.push_back(q);
    }
    if (l.ranks.empty()) continue;
    if (lacking.size() == kMostGroups) {
      ++unsaid;
    } else {
      lacking.push_back(std::move(l));
    }
  }
  return ExplainAt(heading, kind, k, views, lacking, unsaid, 0);
}

int GpuOrder::Of(nn::Device device) {
  const auto it = std::find(indices_.begin(), indices_.end(), device.index);
  if (it != indices_.end()) return static_cast<int>(it - indices_.begin());
  indices_.push_back(device.index);
  return static_cast<int>(indices_.size()) - 1;
}

std::string DescribeTensor(const nn::Tensor& t, bool is_parameter, GpuOrder& gpus) {
  std::string s = std::string(nn::DTypeName(t.dtype())) + " " + nn::ShapeToString(t.shape()) +
                  " strides " + nn::ShapeToString(t.strides());
  // The GPU's order of first appearance, not its index: with one process
  // per GPU, rank r's replica lives on cuda:r and all of them are the same
  // model; a rank with one layer on another GPU than the rest is not.
  if (t.device().is_cuda()) s += " on cuda#" + std::to_string(gpus.Of(t.device()));
  if (is_parameter && !t.requires_grad()) s += " no-grad";
  return s;
}

namespace {

// One rank's EntryView in VerifyReplicas' exchange, identical in size on
// every rank: four int64 (present, count, name hash, value hash), then the
// cut name and value, each NUL-terminated.
constexpr size_t kViewNameBytes = kMostNameBytes + 1;
constexpr size_t kViewValueBytes = kMostValueBytes + 1;
constexpr size_t kViewBytes = 32 + kViewNameBytes + kViewValueBytes;
// The most distinct names at the first difference whose absence on some
// ranks is looked for: one byte per name and rank in the exchange.
constexpr size_t kNamesChecked = 64;
// kNamesChecked, or less for a test (SetNamesCheckedForTesting).
std::atomic<size_t> names_checked{kNamesChecked};

void PutView(const EntryView& v, char* out) {
  const int64_t head[4] = {v.present ? 1 : 0, v.count, static_cast<int64_t>(v.name_hash),
                           static_cast<int64_t>(v.value_hash)};
  std::memcpy(out, head, sizeof(head));
  std::memcpy(out + 32, v.name.data(), std::min(v.name.size(), kViewNameBytes - 1));
  std::memcpy(out + 32 + kViewNameBytes, v.value.data(), std::min(v.value.size(), kViewValueBytes - 1));
}

EntryView GetView(const char* in) {
  int64_t head[4];
  std::memcpy(head, in, sizeof(head));
  EntryView v;
  v.present = head[0] != 0;
  v.count = head[1];
  v.name_hash = static_cast<uint64_t>(head[2]);
  v.value_hash = static_cast<uint64_t>(head[3]);
  v.name.assign(in + 32, strnlen(in + 32, kViewNameBytes - 1));
  v.value.assign(in + 32 + kViewNameBytes, strnlen(in + 32 + kViewNameBytes, kViewValueBytes - 1));
  return v;
}

// The mismatch message, on every rank alike, at a cost that does not grow
// with the world size beyond a small record per rank: rank 0's description
// is broadcast and each rank compares its own with it; the ranks then
// share where each first differs, their entries there, and which of the
// names there each of them has.
std::string ExplainAcrossRanks(ProcessGroup& pg, const std::vector<ReplicaEntry>& entries, const std::string& text,
                               int64_t reference_bytes, const std::string& heading) {
  const int size = pg.size();
  nn::Tensor reference = nn::Zeros({std::max<int64_t>(reference_bytes, 1)}, {.dtype = nn::DType::kUInt8});
  if (pg.rank() == 0) std::memcpy(reference.data_ptr(), text.data(), text.size());
  pg.Broadcast(reference, 0, "model description").Wait();
  const std::vector<ReplicaEntry> rank0 =
      Parse(std::string(static_cast<const char*>(reference.data_ptr()), static_cast<size_t>(reference_bytes)));
  reference = nn::Tensor();

  const auto [my_kind, my_k] = FirstDifference(rank0, entries);
  nn::Tensor mine = nn::FromVectorOf<int64_t>({my_kind, my_k}, {2});
  nn::Tensor places = nn::Empty({2 * static_cast<int64_t>(size)}, {.dtype = nn::DType::kInt64});
  pg.AllGather(places, mine, "model difference").Wait();
  std::pair<int64_t, int64_t> first{kNoDifference, 0};
  for (int r = 0; r < size; ++r) first = std::min(first, {places.data<int64_t>()[2 * r], places.data<int64_t>()[2 * r + 1]});
  // Every rank has the same `first`; the hashes differed, so some rank
  // differs from rank 0 unless two descriptions hashed alike.
  if (first.first == kNoDifference) return heading + " The difference could not be located.";
  const std::string kind = kKinds[first.first];
  const size_t k = static_cast<size_t>(first.second);

  const std::vector<const ReplicaEntry*> list = OfKind(entries, kind);
  nn::Tensor my_view = nn::Zeros({static_cast<int64_t>(kViewBytes)}, {.dtype = nn::DType::kUInt8});
  PutView(ViewOf(list, k), static_cast<char*>(my_view.data_ptr()));
  nn::Tensor all_views = nn::Empty({static_cast<int64_t>(kViewBytes) * size}, {.dtype = nn::DType::kUInt8});
  pg.AllGather(all_views, my_view, "model entries at the difference").Wait();
  std::vector<EntryView> views;
  for (int r = 0; r < size; ++r) views.push_back(GetView(static_cast<const char*>(all_views.data_ptr()) + r * kViewBytes));
  all_views = nn::Tensor();

  // The distinct names at #k (by hash, in rank order), and whether each
  // rank has an entry of that name anywhere.
  const size_t checked = names_checked.load(std::memory_order_relaxed);
  std::vector<size_t> named_by;  // a rank whose view shows the name
  std::vector<uint64_t> hashes;  // the first `checked` of them
  std::unordered_set<uint64_t> distinct;
  for (int r = 0; r < size; ++r) {
    if (!views[r].present || !distinct.insert(views[r].name_hash).second) continue;
    if (hashes.size() < checked) {
      hashes.push_back(views[r].name_hash);
      named_by.push_back(static_cast<size_t>(r));
    }
  }
  std::unordered_set<uint64_t> my_names;
  for (const ReplicaEntry* e : list) my_names.insert(Fnv1a(e->name));
  nn::Tensor has = nn::Zeros({static_cast<int64_t>(checked)}, {.dtype = nn::DType::kUInt8});
  for (size_t i = 0; i < hashes.size(); ++i) has.data<uint8_t>()[i] = my_names.count(hashes[i]) ? 1 : 0;
  nn::Tensor all_has = nn::Empty({static_cast<int64_t>(checked) * size}, {.dtype = nn::DType::kUInt8});
  pg.AllGather(all_has, has, "model names at the difference").Wait();
  std::vector<Lacking> lacking;
  size_t unsaid = 0;
  for (size_t i = 0; i < hashes.size(); ++i) {
    Lacking l{views[named_by[i]].name, {}};
    for (int q = 0; q < size; ++q) {
      if (all_has.data<uint8_t>()[q * checked + i] == 0) l.ranks.push_back(q);
    }
    if (l.ranks.empty()) continue;
    if (lacking.size() == kMostGroups) {
      ++unsaid;
    } else {
      lacking.push_back(std::move(l));
    }
  }
  return ExplainAt(heading, kind, k, views, lacking, unsaid, distinct.size() - hashes.size());
}

}  // namespace

void VerifyReplicas(ProcessGroup& pg, const std::vector<ReplicaEntry>& entries, const std::string& heading) {
  if (pg.size() == 1) return;
  const std::string text = Serialize(entries);
  nn::Tensor mine = nn::FromVectorOf<int64_t>(
      {static_cast<int64_t>(Fnv1a(text) >> 1), static_cast<int64_t>(text.size())}, {2});
  nn::Tensor all = nn::Empty({2 * static_cast<int64_t>(pg.size())}, {.dtype = nn::DType::kInt64});
  pg.AllGather(all, mine, "model fingerprint").Wait();
  const int64_t* a = all.data<int64_t>();
  bool same = true;
  for (int r = 0; r < pg.size(); ++r) same = same && a[2 * r] == a[0] && a[2 * r + 1] == a[1];
  if (same) return;
  std::string message;
  try {
    message = ExplainAcrossRanks(pg, entries, text, a[1], heading);
  } catch (const DistributedError&) {
    // A collective failed (a peer lost, the group aborted elsewhere): the
    // group already holds that reason, which names the rank at fault.
    throw;
  } catch (const std::exception& e) {
    // This rank failed alone (out of memory, say) between the exchanges:
    // the others would wait for it in the next one until the group's
    // timeout, without the cause.
    pg.Abort(transport::FailedPreconditionError(
        "comparing the ranks' models failed on rank " + std::to_string(pg.rank()) + " (" + e.what() +
        "); the other ranks would wait for it. The process group was aborted."));
    throw;
  }
  throw std::invalid_argument(message);
}

std::vector<std::vector<size_t>> GroupByDtypeAndDevice(const std::vector<nn::Tensor>& tensors) {
  using Key = std::tuple<nn::DType, int, int>;  // dtype, device type, device index
  std::map<Key, size_t> place;                   // the key's group in `groups`
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const nn::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    const auto [it, added] =
        place.try_emplace({t.dtype(), static_cast<int>(t.device().type), t.device().index}, groups.size());
    if (added) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  return groups;
}

int Utf8PrefixBytes(const char* text, int most) noexcept {
  if (most <= 0) return 0;
  int kept = static_cast<int>(strnlen(text, static_cast<size_t>(most)));
  if (kept < most) return kept;  // all of it
  // text[most] is readable (the text is longer than `most`, or ends there);
  // a continuation byte there means a character starts before the cut.
  for (int step = 0; step < 3 && kept > 0 && (static_cast<unsigned char>(text[kept]) & 0xc0) == 0x80; ++step) {
    --kept;
  }
  return kept;
}

namespace {

// What the exception `e` says, valid while `e` lives; nothing is
// allocated.
const char* WhatOf(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an exception that is not a std::exception";
}

bool IsOutOfMemory(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return true;
  } catch (...) {
  }
  return false;
}

std::function<void(int)> bucket_fault;  // SetBucketFaultForTesting's

void BroadcastBuckets(ProcessGroup& pg, const std::vector<nn::Tensor>& tensors,
                      const std::vector<std::vector<size_t>>& groups, int root, const std::string& label,
                      size_t bucket_bytes);

}  // namespace

void SetBucketFaultForTesting(std::function<void(int bucket)> fault) { bucket_fault = std::move(fault); }

void BroadcastCoalesced(ProcessGroup& pg, const std::vector<nn::Tensor>& tensors, int root,
                        const std::string& label, size_t bucket_bytes) {
  if (pg.size() == 1) return;
  if (bucket_bytes == 0) throw std::invalid_argument("BroadcastCoalesced: bucket_bytes must be positive");
  // One flat buffer per (dtype, device) and bucket: parameters of a model
  // spread over a CPU and a GPU part, or mixing f32 and bf16, broadcast a
  // bucket at a time, so that the copy costs at most `bucket_bytes` beside
  // the model (one flat buffer of the whole model, on its device, ran a
  // large model out of memory at wrapping).
  nn::NoGradGuard guard;
  // Where it threw decides whether to abort, not what threw: the checks
  // below run alike on every rank before the first exchange, so a refusal
  // there (a device with no backend, say) leaves the group usable; from
  // the first bucket on, the ranks diverge (the root fills the flat
  // buffer, the others copy out of it, each allocates on its own), and a
  // failure, of whatever type, may be this rank's alone while the others
  // are in, or on their way to, a bucket's broadcast.
  bool checked = false;
  try {
    const std::vector<std::vector<size_t>> groups = GroupByDtypeAndDevice(tensors);
    for (const std::vector<size_t>& members : groups) nn::GetDeviceBackend(tensors[members.front()].device());
    checked = true;
    BroadcastBuckets(pg, tensors, groups, root, label, bucket_bytes);
  } catch (...) {
    // Memory running short is this rank's own, wherever it happened.
    if (!checked && !IsOutOfMemory(std::current_exception())) throw;
    bool aborted = false;  // a failed collective aborts the group with its own reason
    try {
      aborted = !pg.aborted_reason().ok();
    } catch (...) {
      // Not known: abort it (an aborted group keeps its first reason).
    }
    if (aborted) throw;
    // Abort the group so that the others fail at once with the cause,
    // instead of waiting for this rank until the group's timeout. The
    // reason is built in a fixed buffer, since memory may be what ran
    // out.
    char reason[768];
    const char* what = WhatOf(std::current_exception());
    std::snprintf(reason, sizeof(reason), "broadcasting the %.*s failed on rank %d: %.*s",
                  Utf8PrefixBytes(label.c_str(), 128), label.c_str(), pg.rank(), Utf8PrefixBytes(what, 512), what);
    try {
      pg.Abort(transport::AbortedError(reason));
    } catch (...) {
      // Nothing more can be done: the others wait until the group's timeout.
    }
    throw;
  }
}

namespace {

// BroadcastCoalesced's work, once the arguments passed.
void BroadcastBuckets(ProcessGroup& pg, const std::vector<nn::Tensor>& tensors,
                      const std::vector<std::vector<size_t>>& groups, int root, const std::string& label,
                      size_t bucket_bytes) {
  int bucket = 0;
  for (const std::vector<size_t>& members : groups) {
    const nn::DType dtype = tensors[members.front()].dtype();
    const nn::Device device = tensors[members.front()].device();
    const size_t elem = nn::ElementSize(dtype);
    std::string what = label + " " + std::string(nn::DTypeName(dtype));
    // The device type alone: the label is part of the collective's
    // fingerprint (DDP_DEBUG=detail), and rank r's replica is on cuda:r.
    if (device.is_cuda()) what += " on cuda";
    // Buckets of consecutive tensors up to `bucket_bytes`; a tensor larger
    // than that is a bucket of its own. Every rank has the same shapes
    // (VerifyReplicas), so every rank forms the same buckets.
    for (size_t first = 0; first < members.size();) {
      size_t end = first + 1, bytes = tensors[members[first]].nbytes();
      while (end < members.size() && bytes + tensors[members[end]].nbytes() <= bucket_bytes) {
        bytes += tensors[members[end]].nbytes();
        ++end;
      }
      std::vector<nn::Tensor> list;
      for (size_t i = first; i < end; ++i) list.push_back(tensors[members[i]]);
      first = end;
      if (bucket_fault) bucket_fault(bucket);
      ++bucket;
      if (list.size() == 1 && list.front().is_contiguous()) {
        // One contiguous tensor: broadcast in place, no flat copy (the
        // broadcast bumps its version where it writes it).
        pg.Broadcast(list.front().Detach(), root, what).Wait();
        continue;
      }
      int64_t total = 0;
      for (const nn::Tensor& t : list) total += t.numel();
      nn::Tensor flat = nn::Empty({total}, {.dtype = dtype, .device = device});
      if (pg.rank() == root) {
        int64_t offset = 0;
        for (const nn::Tensor& t : list) {
          flat.Narrow(0, offset, t.numel()).View(t.shape()).CopyFrom(t);
          offset += t.numel();
        }
      }
      pg.Broadcast(flat, root, what).Wait();
      if (pg.rank() == root) continue;
      int64_t offset = 0;
      for (const nn::Tensor& t : list) {
        if (t.is_contiguous() && device.is_cpu()) {
          std::memcpy(t.data_ptr(), static_cast<const char*>(flat.data_ptr()) + offset * elem, t.nbytes());
          t.storage()->BumpVersion();
        } else {
          t.CopyFrom(flat.Narrow(0, offset, t.numel()).View(t.shape()));
        }
        offset += t.numel();
      }
    }
  }
}

}  // namespace

void SetNamesCheckedForTesting(size_t most) {
  names_checked.store(most == 0 ? kNamesChecked : std::min(most, kNamesChecked), std::memory_order_relaxed);
}

}  // namespace ddp::dist::internal
