#include "ddp/zero_groups.h"

#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace ddp::dist::internal {
namespace {

// "size" or "params" for a "param_groups.<k>.size" or ".params" key, with
// k; "" for any other key.
std::string GroupEntryOf(const std::string& key, size_t* group) {
  const std::string prefix = "param_groups.";
  if (key.rfind(prefix, 0) != 0) return "";
  const size_t dot = key.find('.', prefix.size());
  if (dot == std::string::npos) return "";
  const std::string index = key.substr(prefix.size(), dot - prefix.size());
  const std::string field = key.substr(dot + 1);
  if (index.empty() || index.size() > 9 || index.find_first_not_of("0123456789") != std::string::npos ||
      (field != "size" && field != "params")) {
    return "";
  }
  *group = std::stoul(index);
  return field;
}

// The shortest decimal text that reads back as `value` ("0.05", not
// "0.050000000000000003"), so that two ranks' values differ in text iff
// they differ.
std::string ExactText(double value) {
  std::ostringstream text;
  for (int digits = 15; digits <= 17; ++digits) {
    text.str("");
    text.precision(digits);
    text << value;
    if (std::strtod(text.str().c_str(), nullptr) == value) break;
  }
  return text.str();
}

}  // namespace

std::string GroupOptionsText(const std::map<std::string, double>& options) {
  std::ostringstream text;
  text.precision(17);
  for (const auto& [name, value] : options) text << (text.tellp() > 0 ? ", " : "") << name << "=" << value;
  return text.str();
}

std::vector<std::pair<std::string, std::string>> SharedOptimizerOptions(const nn::optim::NamedTensors& state) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, t] : state) {
    size_t group = 0;
    const bool shared = key == "lr" || (key.rfind("group.", 0) == 0 && key != "group.params_listed") ||
                        (key.rfind("param_groups.", 0) == 0 && GroupEntryOf(key, &group).empty());
    if (!shared || !t.defined()) continue;
    const nn::Tensor v = t.To(nn::kCPU).Contiguous();
    std::string text;
    if (v.dtype() == nn::DType::kUInt8) {
      text.assign(static_cast<const char*>(v.data_ptr()), static_cast<size_t>(v.numel()));
    } else if (v.dtype() == nn::DType::kInt64) {
      for (int64_t i = 0; i < v.numel(); ++i) text += (i > 0 ? " " : "") + std::to_string(v.data<int64_t>()[i]);
    } else {
      const nn::Tensor d = v.To(nn::DType::kFloat64);
      for (int64_t i = 0; i < d.numel(); ++i) text += (i > 0 ? " " : "") + ExactText(d.data<double>()[i]);
    }
    out.emplace_back(key, text);
  }
  return out;
}

void RewriteGroups(nn::optim::NamedTensors& state, size_t num_groups,
                   const std::vector<std::vector<std::string>>& from,
                   const std::vector<std::vector<std::string>>& to) {
  if (num_groups == 1) return;
  // A state with another group count (or none) is left as it is, for the
  // shard's optimizer to refuse naming both counts.
  int64_t count = -1;
  for (const auto& [key, t] : state) {
    if (key == "param_groups.count" && t.defined() && t.dtype() == nn::DType::kInt64 && t.shape() == nn::Shape{}) {
      count = t.To(nn::kCPU).data<int64_t>()[0];
    }
  }
  if (count != static_cast<int64_t>(num_groups)) return;
  for (auto& [key, t] : state) {
    size_t k = 0;
    const std::string field = GroupEntryOf(key, &k);
    if (field.empty() || k >= num_groups) continue;
    const std::string group = "param group " + std::to_string(k);
    if (field == "size") {
      // Malformed entries are left for the shard's optimizer to refuse.
      if (!t.defined() || t.dtype() != nn::DType::kInt64 || t.shape() != nn::Shape{}) continue;
      const int64_t saved = t.To(nn::kCPU).data<int64_t>()[0];
      if (saved != static_cast<int64_t>(from[k].size())) {
        throw std::invalid_argument("state entry `" + key + "`: the state's " + group + " has " +
                                    std::to_string(saved) + " parameter(s); this optimizer's has " +
                                    std::to_string(from[k].size()));
      }
      t = nn::FromVectorOf<int64_t>({static_cast<int64_t>(to[k].size())}, {});
    } else {
      std::vector<std::string> saved;
      if (!nn::optim::internal::GroupMembersOf(t, &saved)) continue;
      if (saved != from[k]) {
        size_t j = 0;
        while (j < saved.size() && j < from[k].size() && saved[j] == from[k][j]) ++j;
        throw std::invalid_argument(
            "state entry `" + key + "`: the state's " + group + " holds other parameters: " +
            (j < saved.size() ? "`" + saved[j] + "`" : std::string("nothing more")) + " where this optimizer has " +
            (j < from[k].size() ? "`" + from[k][j] + "`" : std::string("nothing more")) +
            " (make the groups as they were saved, in the same order)");
      }
      t = nn::optim::internal::GroupMembersTensor(to[k]);
    }
  }
}

}  // namespace ddp::dist::internal
