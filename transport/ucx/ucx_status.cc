#include "transport/ucx/ucx_status.h"

#include <string>

namespace ddp::transport::ucx {

Status FromUcs(ucs_status_t status, std::string_view what) {
  if (status == UCS_OK) return Status::Ok();
  std::string message = std::string(what) + ": " + ucs_status_string(status);
  switch (status) {
    // A peer that died or whose link went down surfaces as one of these once
    // the endpoint runs in peer error-handling mode.
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
      return PeerLostError(std::move(message));
    case UCS_ERR_TIMED_OUT:
      return TimedOutError(std::move(message));
    case UCS_ERR_CANCELED:
      return AbortedError(std::move(message));
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return InvalidArgumentError(std::move(message));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return ResourceExhaustedError(std::move(message));
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_IO_ERROR:
      return UnavailableError(std::move(message));
    default:
      return InternalError(std::move(message));
  }
}

Status FromUcsOfPeerTraffic(ucs_status_t status, std::string_view what) {
  // On a connected endpoint the shared-memory transports report a peer's
  // segment that can no longer be attached or written (its process exited
  // and the segment went with it) this way: a send to a rank killed
  // mid-collective. Elsewhere (creating a worker or an endpoint) the same
  // code is a setup problem (shmat refused, another IPC namespace) and stays
  // FromUcs's INTERNAL.
  if (status == UCS_ERR_SHMEM_SEGMENT) {
    return PeerLostError(std::string(what) + ": " + ucs_status_string(status));
  }
  return FromUcs(status, what);
}

}  // namespace ddp::transport::ucx
