#ifndef DDP_TRANSPORT_PIPE_WRITE_H_
#define DDP_TRANSPORT_PIPE_WRITE_H_

// Writing to a pipe or terminal whose reader may go away (`ddprun ... |
// tee log` after a Ctrl-C ended tee, a FIFO's `cat` that was stopped).

#include <sys/types.h>

#include <string_view>

namespace ddp::transport {

/// write(2) of `data` to `fd` that returns -1 with errno EPIPE where the
/// reader is gone, without raising SIGPIPE, whose default action would end
/// the whole process (and, by PR_SET_PDEATHSIG, a launcher's workers). The
/// signal is held blocked over the write and the one it raised is taken
/// back, leaving the process's handling of SIGPIPE as it was. Otherwise as
/// write(2): it may write part of `data`.
ssize_t WriteWithoutSigpipe(int fd, std::string_view data);

}  // namespace ddp::transport

#endif  // DDP_TRANSPORT_PIPE_WRITE_H_
