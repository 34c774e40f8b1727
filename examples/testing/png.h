#ifndef DDP_EXAMPLES_TESTING_PNG_H_
#define DDP_EXAMPLES_TESTING_PNG_H_

// A small PNG reader for tests that look at screenshots: 8-bit grey, RGB or
// RGBA (with or without alpha), not interlaced, which is what Chromium's
// --screenshot writes. Test-only.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::examples::testing {

/// Decoded pixels, always as RGBA.
struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgba;  ///< width * height * 4 bytes, row-major.

  /// Pixels within `tolerance` (per channel) of the colour #rrggbb.
  int64_t CountColor(uint32_t rgb, int tolerance) const;
};

/// Decodes PNG file bytes; throws std::runtime_error naming what it cannot
/// read (bad signature, unsupported format, corrupt data).
Image DecodePng(const std::string& bytes);

/// "#1f77b4" -> 0x1f77b4.
uint32_t ParseHexColor(const std::string& color);

}  // namespace ddp::examples::testing

#endif  // DDP_EXAMPLES_TESTING_PNG_H_
