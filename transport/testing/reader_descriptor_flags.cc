#include "transport/testing/reader_descriptor_flags.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace ddp::transport::testing {

int FlagsOfTheReadersDescriptor(const std::string& path, const std::function<void()>& read) {
  if (mkfifo(path.c_str(), 0600) != 0) return -1;
  // This side holds the FIFO open for reading and writing (Linux lets a FIFO
  // be opened so, without waiting): the reader's open finds a writer and
  // returns, and its read waits until `hold` closes. A plain writer opened
  // only once the reader had it open, and a reader that opened the FIFO
  // again after that writer had closed waited in open() forever.
  int hold = open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  // Only a reader end, kept to the last: through it the FIFO can be opened
  // for writing again once its name is gone (see below).
  const int spare = hold < 0 ? -1 : open(("/proc/self/fd/" + std::to_string(hold)).c_str(),
                                         O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (hold < 0 || spare < 0) {
    if (hold >= 0) close(hold);
    unlink(path.c_str());
    return -1;
  }
  std::atomic<bool> done{false};
  std::thread reader([&] {
    read();
    done.store(true);
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int flags = -1;
  const std::string target = std::filesystem::canonical(path).string();
  while (flags < 0 && !done.load() && std::chrono::steady_clock::now() < until) {
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code error;
      const int fd = std::stoi(entry.path().filename().string());
      if (fd == hold || fd == spare ||
          std::filesystem::read_symlink(entry.path(), error).string() != target) {
        continue;
      }
      std::ifstream info("/proc/self/fdinfo/" + std::to_string(fd));
      for (std::string line; std::getline(info, line);) {
        if (line.rfind("flags:", 0) == 0) flags = static_cast<int>(std::stol(line.substr(6), nullptr, 8));
      }
    }
    if (flags < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // A later open of the path fails (ENOENT) instead of waiting for a writer.
  unlink(path.c_str());
  close(hold);  // the reader sees the end of the file
  // An open that found the name before it went may still be waiting for a
  // writer: a writer comes and goes until the reader is done.
  const std::string again = "/proc/self/fd/" + std::to_string(spare);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done.load()) {
    if (std::chrono::steady_clock::now() >= give_up) {
      std::fprintf(stderr, "FlagsOfTheReadersDescriptor: the reader of %s did not return within 10 s "
                           "of the end of the file\n", path.c_str());
      std::abort();
    }
    const int writer = open(again.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (writer >= 0) close(writer);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  reader.join();
  close(spare);
  return flags;
}

}  // namespace ddp::transport::testing
