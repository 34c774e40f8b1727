#include "transport/ucx/resources.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "transport/fork/fork_guard.h"
#include "transport/ucx/ucx_status.h"

namespace ddp::transport::ucx {
namespace {

bool EnvSet(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0';
}

// Receive buffers each memory-mapped transport (sysv, posix, xpmem) makes
// when its interface opens, and again each time its pool runs dry. UCX's
// 512 buffers of 8 KiB are 4 MiB per transport, written once each at
// worker creation: page faults that made ucp_worker_create take about
// 17 ms of a quiet run here (sysv and posix both open under "sm") and
// 75-85 ms with two ranks starting on two busy cores, most of a rank's
// start. 128 still covers a full receive FIFO (64 entries by default)
// twice over; a burst that holds more grows the pool by as many again,
// on a path that already waits for a slow receiver.
constexpr char kMmRxBufsGrow[] = "128";

// Whether the user set any variable that sizes the memory-mapped
// transports' receive FIFO or pool: theirs is left exactly as they set it.
bool UserSizedMemoryMappedReceive() {
  for (const char* name : {"UCX_MM_RX_BUFS_GROW", "UCX_SYSV_RX_BUFS_GROW", "UCX_POSIX_RX_BUFS_GROW",
                           "UCX_XPMEM_RX_BUFS_GROW", "UCX_MM_FIFO_SIZE", "UCX_SYSV_FIFO_SIZE",
                           "UCX_POSIX_FIFO_SIZE", "UCX_XPMEM_FIFO_SIZE"}) {
    if (EnvSet(name)) return true;
  }
  return false;
}

}  // namespace

bool OpensMemoryMappedTransports(std::string_view tls) {
  if (tls.empty() || tls.front() == '^') return false;
  while (!tls.empty()) {
    const size_t comma = tls.find(',');
    const std::string_view name = tls.substr(0, comma);
    for (std::string_view mm : {"all", "sm", "shm", "mm", "sysv", "posix", "xpmem"}) {
      if (name == mm) return true;
    }
    if (comma == std::string_view::npos) break;
    tls.remove_prefix(comma + 1);
  }
  return false;
}

StatusOr<std::shared_ptr<Context>> Context::Create(const ContextOptions& options) {
  // UCX's global state in a forked child is the parent's (its threads and
  // memory hooks); a context made there hangs or corrupts it.
  DDP_RETURN_IF_ERROR(fork::CheckNotForkedChild("creating a UCX context"));
  ucp_config_t* config = nullptr;
  DDP_RETURN_IF_ERROR(FromUcs(ucp_config_read(nullptr, nullptr, &config), "reading UCX configuration"));
  std::string tls = EnvSet("UCX_TLS") ? std::getenv("UCX_TLS") : "all";
  // The user's UCX_TLS / UCX_NET_DEVICES always win; our defaults only fill
  // in what they left unset.
  if (!EnvSet("UCX_TLS") && !options.default_tls.empty()) {
    Status s = FromUcs(ucp_config_modify(config, "TLS", options.default_tls.c_str()),
                       "setting UCX TLS=" + options.default_tls);
    if (!s.ok()) {
      ucp_config_release(config);
      return s;
    }
    tls = options.default_tls;
  }
  if (!EnvSet("UCX_NET_DEVICES") && !options.default_net_devices.empty()) {
    Status s = FromUcs(ucp_config_modify(config, "NET_DEVICES", options.default_net_devices.c_str()),
                       "setting UCX NET_DEVICES=" + options.default_net_devices);
    if (!s.ok()) {
      ucp_config_release(config);
      return s;
    }
  }

  if (OpensMemoryMappedTransports(tls) && !UserSizedMemoryMappedReceive()) {
    // Only a start-up saving: a UCX that takes no transport settings
    // through ucp_config_modify (older than 1.9) keeps its own size.
    static_cast<void>(ucp_config_modify(config, "MM_RX_BUFS_GROW", kMmRxBufsGrow));
  }

  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | (options.wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = 0;
  params.name = options.name.c_str();
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  DDP_RETURN_IF_ERROR(FromUcs(status, "creating the UCX context (UCX_TLS=" + tls + ")"));
  // Debian's UCX is built without CUDA and never reports it; a CUDA-enabled
  // UCX does when its cuda transports are among those in use.
  ucp_context_attr_t attributes;
  std::memset(&attributes, 0, sizeof(attributes));
  attributes.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const bool cuda_memory =
      ucp_context_query(context, &attributes) == UCS_OK &&
      (attributes.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  return std::shared_ptr<Context>(new Context(context, options.wakeup, tls, cuda_memory));
}

Context::~Context() { ucp_cleanup(context_); }

StatusOr<std::unique_ptr<Worker>> Worker::Create(std::shared_ptr<Context> context) {
  if (context == nullptr) return InvalidArgumentError("UCX worker: no context (null)");
  ucp_worker_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // SERIALIZED: the communicator guarantees one thread at a time in the
  // worker (its mutex), but blocking and async calls use different threads.
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h handle = nullptr;
  DDP_RETURN_IF_ERROR(FromUcs(ucp_worker_create(context->get(), &params, &handle),
                              "creating the UCX worker"));
  const bool wakeup = context->wakeup();
  std::unique_ptr<Worker> worker(new Worker(std::move(context), handle));

  ucp_address_t* address = nullptr;
  size_t length = 0;
  DDP_RETURN_IF_ERROR(FromUcs(ucp_worker_get_address(handle, &address, &length),
                              "reading the UCX worker address"));
  worker->address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(handle, address);

  if (wakeup) {
    DDP_RETURN_IF_ERROR(FromUcs(ucp_worker_get_efd(handle, &worker->event_fd_),
                                "reading the UCX worker event fd"));
    worker->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (worker->epoll_fd_ < 0) {
      return InternalError(std::string("epoll_create1: ") + std::strerror(errno));
    }
    epoll_event event{};
    event.events = EPOLLIN;
    if (epoll_ctl(worker->epoll_fd_, EPOLL_CTL_ADD, worker->event_fd_, &event) != 0) {
      return InternalError(std::string("epoll_ctl on the UCX event fd: ") + std::strerror(errno));
    }
  }
  return worker;
}

Worker::~Worker() {
  if (epoll_fd_ >= 0) close(epoll_fd_);
  ucp_worker_destroy(worker_);
}

Status Worker::WaitForEvents(int timeout_ms) {
  if (epoll_fd_ < 0) return FailedPreconditionError("UCX worker created without wakeup");
  ucs_status_t status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) return Status::Ok();  // events already pending
  DDP_RETURN_IF_ERROR(FromUcs(status, "arming the UCX worker"));
  epoll_event event{};
  int n = epoll_wait(epoll_fd_, &event, 1, timeout_ms);
  if (n < 0 && errno != EINTR) {
    return InternalError(std::string("epoll_wait on the UCX event fd: ") + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace ddp::transport::ucx
