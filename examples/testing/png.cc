#include "examples/testing/png.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>

namespace ddp::examples::testing {
namespace {

uint32_t BigEndian32(const std::string& s, size_t at) {
  return (uint32_t{static_cast<uint8_t>(s[at])} << 24) |
         (uint32_t{static_cast<uint8_t>(s[at + 1])} << 16) |
         (uint32_t{static_cast<uint8_t>(s[at + 2])} << 8) | uint32_t{static_cast<uint8_t>(s[at + 3])};
}

int Paeth(int a, int b, int c) {
  const int p = a + b - c;
  const int pa = std::abs(p - a);
  const int pb = std::abs(p - b);
  const int pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return a;
  return pb <= pc ? b : c;
}

}  // namespace

int64_t Image::CountColor(uint32_t rgb, int tolerance) const {
  const int r = (rgb >> 16) & 255;
  const int g = (rgb >> 8) & 255;
  const int b = rgb & 255;
  int64_t n = 0;
  for (size_t i = 0; i + 3 < rgba.size(); i += 4) {
    if (std::abs(rgba[i] - r) <= tolerance && std::abs(rgba[i + 1] - g) <= tolerance &&
        std::abs(rgba[i + 2] - b) <= tolerance) {
      ++n;
    }
  }
  return n;
}

uint32_t ParseHexColor(const std::string& color) {
  if (color.size() != 7 || color[0] != '#') throw std::runtime_error("not a #rrggbb colour: " + color);
  return static_cast<uint32_t>(std::stoul(color.substr(1), nullptr, 16));
}

Image DecodePng(const std::string& bytes) {
  static const char kSignature[] = "\x89PNG\r\n\x1a\n";
  if (bytes.size() < 8 || std::memcmp(bytes.data(), kSignature, 8) != 0) {
    throw std::runtime_error("not a PNG file (bad signature)");
  }
  Image img;
  int bit_depth = 0, color_type = -1, interlace = 0;
  std::string idat;
  size_t at = 8;
  while (at + 12 <= bytes.size()) {
    const uint32_t length = BigEndian32(bytes, at);
    const std::string type = bytes.substr(at + 4, 4);
    if (at + 12 + length > bytes.size()) throw std::runtime_error("truncated PNG chunk " + type);
    const size_t data = at + 8;
    if (type == "IHDR") {
      img.width = static_cast<int>(BigEndian32(bytes, data));
      img.height = static_cast<int>(BigEndian32(bytes, data + 4));
      bit_depth = static_cast<uint8_t>(bytes[data + 8]);
      color_type = static_cast<uint8_t>(bytes[data + 9]);
      interlace = static_cast<uint8_t>(bytes[data + 12]);
    } else if (type == "IDAT") {
      idat.append(bytes, data, length);
    } else if (type == "IEND") {
      break;
    }
    at += 12 + length;
  }
  int channels = 0;
  switch (color_type) {
    case 0: channels = 1; break;
    case 2: channels = 3; break;
    case 4: channels = 2; break;
    case 6: channels = 4; break;
    default: throw std::runtime_error("unsupported PNG colour type " + std::to_string(color_type));
  }
  if (bit_depth != 8 || interlace != 0 || img.width <= 0 || img.height <= 0) {
    throw std::runtime_error("unsupported PNG (bit depth " + std::to_string(bit_depth) +
                             ", interlace " + std::to_string(interlace) + ")");
  }
  const size_t stride = static_cast<size_t>(img.width) * channels;
  std::vector<uint8_t> raw((stride + 1) * img.height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) !=
          Z_OK ||
      raw_size != raw.size()) {
    throw std::runtime_error("corrupt PNG image data");
  }
  std::vector<uint8_t> pixels(stride * img.height);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = raw[y * (stride + 1)];
    const uint8_t* in = &raw[y * (stride + 1) + 1];
    uint8_t* out = &pixels[y * stride];
    const uint8_t* up = y > 0 ? &pixels[(y - 1) * stride] : nullptr;
    for (size_t x = 0; x < stride; ++x) {
      const int a = x >= static_cast<size_t>(channels) ? out[x - channels] : 0;
      const int b = up != nullptr ? up[x] : 0;
      const int c = (up != nullptr && x >= static_cast<size_t>(channels)) ? up[x - channels] : 0;
      int v = in[x];
      switch (filter) {
        case 0: break;
        case 1: v += a; break;
        case 2: v += b; break;
        case 3: v += (a + b) / 2; break;
        case 4: v += Paeth(a, b, c); break;
        default: throw std::runtime_error("bad PNG filter " + std::to_string(filter));
      }
      out[x] = static_cast<uint8_t>(v);
    }
  }
  img.rgba.resize(static_cast<size_t>(img.width) * img.height * 4);
  for (size_t i = 0, n = static_cast<size_t>(img.width) * img.height; i < n; ++i) {
    const uint8_t* p = &pixels[i * channels];
    uint8_t* q = &img.rgba[i * 4];
    if (channels <= 2) {
      q[0] = q[1] = q[2] = p[0];
      q[3] = channels == 2 ? p[1] : 255;
    } else {
      q[0] = p[0];
      q[1] = p[1];
      q[2] = p[2];
      q[3] = channels == 4 ? p[3] : 255;
    }
  }
  return img;
}

}  // namespace ddp::examples::testing
