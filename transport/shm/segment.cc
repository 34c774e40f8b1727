#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

namespace ddp::transport::shm {
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

StatusOr<std::unique_ptr<Segment>> Segment::CreateShared(store::Store& store,
                                                         const std::string& key_prefix,
                                                         int group_rank, int group_size,
                                                         size_t bytes, Deadline deadline) {
  const std::string name_key = key_prefix + "name";
  std::string name;
  int fd = -1;
  if (group_rank == 0) {
    std::random_device random;
    name = "/ddp-" + std::to_string(getpid()) + "-" + std::to_string(random());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return UnavailableError(Errno("shm_open(" + name + ")"));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      Status error = ResourceExhaustedError(Errno("sizing shared memory " + name + " to " +
                                                  std::to_string(bytes) + " bytes"));
      close(fd);
      shm_unlink(name.c_str());
      return error;
    }
    Status posted = store.Set(name_key, name, deadline);
    if (!posted.ok()) {
      close(fd);
      shm_unlink(name.c_str());
      return posted;
    }
  } else {
    DDP_ASSIGN_OR_RETURN(name, store.Get(name_key, deadline));
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return UnavailableError(Errno("shm_open(" + name + ") posted by local rank 0"));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) {
    if (group_rank == 0) shm_unlink(name.c_str());
    return ResourceExhaustedError(Errno("mapping shared memory " + name));
  }
  std::unique_ptr<Segment> segment(new Segment(data, bytes));

  // Unlink once everyone has it mapped. Every rank tries, so the name goes
  // even if rank 0 dies right after the last rank mapped it.
  auto mapped = store.Add(key_prefix + "mapped", 1, deadline);
  if (!mapped.ok()) {
    if (group_rank == 0) shm_unlink(name.c_str());
    return mapped.status();
  }
  while (true) {
    auto count = store.Add(key_prefix + "mapped", 0, deadline);
    if (!count.ok()) {
      shm_unlink(name.c_str());
      return count.status();
    }
    if (*count >= group_size) break;
    if (Clock::now() >= deadline) {
      shm_unlink(name.c_str());
      return TimedOutError("shared memory segment " + name + ": only " + std::to_string(*count) +
                           " of " + std::to_string(group_size) + " local ranks mapped it in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  shm_unlink(name.c_str());  // ENOENT when another rank was first: fine
  return segment;
}

Segment::~Segment() { munmap(data_, bytes_); }

}  // namespace ddp::transport::shm
