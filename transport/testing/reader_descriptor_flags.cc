#include "transport/testing/reader_descriptor_flags.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

namespace ddp::transport::testing {

int FlagsOfTheReadersDescriptor(const std::string& path, const std::function<void()>& read) {
  if (mkfifo(path.c_str(), 0600) != 0) return -1;
  std::thread reader(read);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int writer = -1;
  // Non-blocking: ENXIO until the reader has it open.
  while ((writer = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) < 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int flags = -1;
  const std::string target = std::filesystem::canonical(path).string();
  while (writer >= 0 && flags < 0 && std::chrono::steady_clock::now() < until) {
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code error;
      const int fd = std::stoi(entry.path().filename().string());
      if (fd == writer || std::filesystem::read_symlink(entry.path(), error).string() != target) continue;
      std::ifstream info("/proc/self/fdinfo/" + std::to_string(fd));
      for (std::string line; std::getline(info, line);) {
        if (line.rfind("flags:", 0) == 0) flags = static_cast<int>(std::stol(line.substr(6), nullptr, 8));
      }
    }
    if (flags < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (writer >= 0) close(writer);  // the reader sees the end of the file
  reader.join();
  unlink(path.c_str());
  return flags;
}

}  // namespace ddp::transport::testing
