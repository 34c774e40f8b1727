#ifndef DDP_TRANSPORT_UCX_UCX_STATUS_H_
#define DDP_TRANSPORT_UCX_UCX_STATUS_H_

#include <string_view>

#include <ucs/type/status.h>

#include "transport/status.h"

namespace ddp::transport::ucx {

/// The one place where a UCX status becomes a transport Status. `what` says
/// which operation failed ("tag send to rank 3"); it leads the message.
Status FromUcs(ucs_status_t status, std::string_view what);

}  // namespace ddp::transport::ucx

#endif  // DDP_TRANSPORT_UCX_UCX_STATUS_H_
