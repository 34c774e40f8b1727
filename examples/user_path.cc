#include "examples/user_path.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace ddp::examples {

std::string UserWorkingDirectory() {
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY"); dir != nullptr && *dir) {
    return dir;
  }
  std::error_code ec;
  std::filesystem::path cwd = std::filesystem::current_path(ec);
  return ec ? std::string(".") : cwd.string();
}

std::string UserPath(const std::string& path) {
  if (path.empty()) return path;
  std::filesystem::path p(path);
  if (p.is_relative()) p = std::filesystem::path(UserWorkingDirectory()) / p;
  return p.lexically_normal().string();
}

}  // namespace ddp::examples
