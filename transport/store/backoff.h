#ifndef DDP_TRANSPORT_STORE_BACKOFF_H_
#define DDP_TRANSPORT_STORE_BACKOFF_H_

// Pauses between retries of the store's connects and handshakes: doubling
// to a cap and spread by a random draw, so that ranks turned away together
// (nobody listening yet, a full or restarting store) come back apart
// instead of in step. Private to //transport.

#include "transport/types.h"

namespace ddp::transport::store {

/// Pause before the next try after `retry` failed tries in a row (0: after
/// the first), when `unit`, in [0, 1), is the caller's random draw: between
/// half and all of a ceiling that starts at `first` and doubles with each
/// retry up to `most`, and never past `left` (the time to the caller's
/// deadline; none when that is not positive). A `unit` outside [0, 1] is
/// clamped.
Clock::duration RetryPause(int retry, double unit, Clock::duration first, Clock::duration most,
                           Clock::duration left);

/// A draw in [0, 1) for RetryPause from this thread's generator, seeded
/// apart per process and thread (system entropy where it can be read, else
/// the clock, mixed with the pid), so ranks started together draw apart.
double RetryDraw();

}  // namespace ddp::transport::store

#endif  // DDP_TRANSPORT_STORE_BACKOFF_H_
