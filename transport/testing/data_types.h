#ifndef DDP_TRANSPORT_TESTING_DATA_TYPES_H_
#define DDP_TRANSPORT_TESTING_DATA_TYPES_H_

#include "transport/types.h"

namespace ddp::transport::testing {

/// Every DataType, for sweeps.
inline constexpr DataType kAllDataTypes[] = {DataType::kF32,  DataType::kF64, DataType::kF16,
                                             DataType::kBF16, DataType::kI32, DataType::kI64,
                                             DataType::kU8};

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_DATA_TYPES_H_
