#ifndef DDP_TRANSPORT_TESTING_DESCRIPTORS_EXHAUSTED_H_
#define DDP_TRANSPORT_TESTING_DESCRIPTORS_EXHAUSTED_H_

// For tests of what a process does with no file descriptor left (EMFILE):
// while one lives, the soft RLIMIT_NOFILE is 64 and every descriptor below
// it is in use (open on /dev/null); the destructor closes them and puts the
// limit back.

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace ddp::transport::testing {

class DescriptorsExhausted {
 public:
  DescriptorsExhausted() {
    limit_set_ = getrlimit(RLIMIT_NOFILE, &before_) == 0;
    if (limit_set_) {
      rlimit low = before_;
      low.rlim_cur = 64;
      limit_set_ = setrlimit(RLIMIT_NOFILE, &low) == 0;
    }
    while (true) {
      const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      fds_.push_back(fd);
    }
    error_ = errno;
  }
  ~DescriptorsExhausted() {
    for (int fd : fds_) close(fd);
    if (limit_set_) setrlimit(RLIMIT_NOFILE, &before_);
  }
  DescriptorsExhausted(const DescriptorsExhausted&) = delete;
  DescriptorsExhausted& operator=(const DescriptorsExhausted&) = delete;

  /// EMFILE when every descriptor was taken (what a test should assert).
  int error() const { return error_; }

 private:
  rlimit before_{};
  bool limit_set_ = false;
  std::vector<int> fds_;
  int error_ = 0;
};

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_DESCRIPTORS_EXHAUSTED_H_
