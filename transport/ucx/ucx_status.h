#ifndef DDP_TRANSPORT_UCX_UCX_STATUS_H_
#define DDP_TRANSPORT_UCX_UCX_STATUS_H_

#include <string_view>

#include <ucs/type/status.h>

#include "transport/status.h"

namespace ddp::transport::ucx {

/// The one place where a UCX status becomes a transport Status. `what` says
/// which operation failed ("tag send to rank 3"); it leads the message.
Status FromUcs(ucs_status_t status, std::string_view what);

/// FromUcs for a request on a connected endpoint (a send, a receive, a
/// notice): there UCS_ERR_SHMEM_SEGMENT means the peer's shared memory went
/// away with its process, so it is PEER_LOST; FromUcs keeps it INTERNAL,
/// as it is when a worker or an endpoint is created.
Status FromUcsOfPeerTraffic(ucs_status_t status, std::string_view what);

}  // namespace ddp::transport::ucx

#endif  // DDP_TRANSPORT_UCX_UCX_STATUS_H_
