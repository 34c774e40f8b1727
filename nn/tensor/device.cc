#include "nn/tensor/device.h"

#include <charconv>
#include <stdexcept>

namespace ddp::nn {

std::string Device::ToString() const {
  if (type == DeviceType::kCPU) return "cpu";
  return "cuda:" + std::to_string(index);
}

Device Device::Parse(std::string_view text) {
  if (text == "cpu") return kCPU;
  if (text == "cuda") return Device(DeviceType::kCUDA, 0);
  if (text.substr(0, 5) == "cuda:" && text.size() > 5) {
    int index = 0;
    const char* first = text.data() + 5;
    const char* last = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(first, last, index);
    if (ec == std::errc() && ptr == last && index >= 0) return Device(DeviceType::kCUDA, index);
  }
  throw std::invalid_argument("unknown device `" + std::string(text) +
                              "` (expected cpu, cuda or cuda:N)");
}

}  // namespace ddp::nn
