#ifndef DDP_TRANSPORT_UCX_RESOURCES_H_
#define DDP_TRANSPORT_UCX_RESOURCES_H_

// RAII owners of the UCP context and worker. Private to //transport: nothing
// outside transport/ucx includes UCX headers.
//
// Release order matters to UCX: requests, then endpoints, then the worker,
// then the context. Owners hold what they depend on through shared_ptr, so a
// worker cannot outlive its context even if destroyed last by accident.

#include <memory>
#include <string>
#include <string_view>

#include <ucp/api/ucp.h>

#include "transport/status.h"

namespace ddp::transport::ucx {

struct ContextOptions {
  /// Transports used when the user did not set UCX_TLS; empty: UCX's own
  /// default ("all").
  std::string default_tls;
  /// Devices used when the user did not set UCX_NET_DEVICES; empty: UCX's
  /// default ("all").
  std::string default_net_devices;
  /// Enables worker wakeup (an event fd to sleep on while idle).
  bool wakeup = false;
  /// Shown in UCX's own logs.
  std::string name = "ddp";
};

/// Whether the UCX transport list `tls` (as UCX_TLS is written) opens the
/// memory-mapped transports (sysv, posix, xpmem), whose receive pool
/// Context::Create sizes. A negated list ("^tcp") counts as not.
bool OpensMemoryMappedTransports(std::string_view tls);

/// Owns a ucp_context_h.
class Context {
 public:
  static StatusOr<std::shared_ptr<Context>> Create(const ContextOptions& options);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  ucp_context_h get() const { return context_; }
  bool wakeup() const { return wakeup_; }
  /// The transport list in force ("sm,self", or the user's UCX_TLS).
  const std::string& tls() const { return tls_; }
  /// UCX reports CUDA device memory among the memory types it can move
  /// (a CUDA-enabled UCX with a cuda transport in use).
  bool cuda_memory() const { return cuda_memory_; }

 private:
  Context(ucp_context_h context, bool wakeup, std::string tls, bool cuda_memory)
      : context_(context), wakeup_(wakeup), tls_(std::move(tls)), cuda_memory_(cuda_memory) {}
  ucp_context_h context_;
  bool wakeup_;
  std::string tls_;
  bool cuda_memory_;
};

/// Owns a ucp_worker_h (thread mode SERIALIZED: one thread at a time, not
/// always the same one) and its packed address.
class Worker {
 public:
  static StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<Context> context);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_worker_h get() const { return worker_; }
  /// The worker address as bytes, to publish through the store.
  const std::string& address() const { return address_; }
  /// Runs one progress round; returns how many events were processed.
  unsigned Progress() { return ucp_worker_progress(worker_); }
  /// Sleeps until the worker has events or `timeout_ms` passes; needs a
  /// context created with wakeup. Returns early when events are pending.
  Status WaitForEvents(int timeout_ms);

 private:
  Worker(std::shared_ptr<Context> context, ucp_worker_h worker)
      : context_(std::move(context)), worker_(worker) {}
  std::shared_ptr<Context> context_;  // destroyed after worker_
  ucp_worker_h worker_;
  std::string address_;
  int event_fd_ = -1;
  int epoll_fd_ = -1;
};

}  // namespace ddp::transport::ucx

#endif  // DDP_TRANSPORT_UCX_RESOURCES_H_
