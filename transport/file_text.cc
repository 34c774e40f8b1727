#include "transport/file_text.h"

#include <cstdio>

namespace ddp::transport {

std::optional<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return std::nullopt;
  std::string text;
  char block[4096];
  size_t got = 0;
  while ((got = std::fread(block, 1, sizeof(block), file)) > 0) text.append(block, got);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return std::nullopt;
  return text;
}

}  // namespace ddp::transport
