// SetFlushDenormal: the x86 MXCSR bits that make SSE/AVX arithmetic treat
// subnormal floats as zero.

#include "nn/ops/config.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define DDP_NN_HAVE_MXCSR 1
#else
#define DDP_NN_HAVE_MXCSR 0
#endif

namespace ddp::nn::ops {
namespace {

// FTZ (bit 15): subnormal results become zero. DAZ (bit 6): subnormal
// inputs are read as zero. Both, or a subnormal input still takes the slow
// path.
constexpr unsigned kFlushBits = (1u << 15) | (1u << 6);

}  // namespace

bool SetFlushDenormal(bool on) {
#if DDP_NN_HAVE_MXCSR
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | kFlushBits) : (csr & ~kFlushBits));
  return true;
#else
  return !on;
#endif
}

bool GetFlushDenormal() {
#if DDP_NN_HAVE_MXCSR
  return (_mm_getcsr() & kFlushBits) == kFlushBits;
#else
  return false;
#endif
}

}  // namespace ddp::nn::ops
