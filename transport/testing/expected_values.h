#ifndef DDP_TRANSPORT_TESTING_EXPECTED_VALUES_H_
#define DDP_TRANSPORT_TESTING_EXPECTED_VALUES_H_

// Inputs and expected results for collective tests: rank r's element i is a
// small integer, so that sums and products are exact in every dtype (u8 and
// the 16-bit floats included) for up to 9 ranks, and the expected value is a
// closed form computed without any reduction kernel. Beyond 9 ranks the
// product stays at most 2^12 (see InputValue), u8 wraps as its kernels do, and the 16-bit floats' tolerance grows with the rank count,
// so that a reduction done right is not counted wrong (checked up to 128
// ranks in expected_values_test).

#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/types.h"

namespace ddp::transport::testing {

/// Rank `rank`'s input element `i` for `op` (prod uses 1s and 2s: every
/// other element on ranks below 16, then one element in 32 on each rank up
/// to 143, so that any one of them missing from a product of 32 elements
/// or more shows).
double InputValue(int rank, size_t i, ReduceOp op);

/// The all-reduce result of element i over `ranks` ranks.
double ExpectedValue(int ranks, size_t i, ReduceOp op, DataType dtype);

/// Writes `value` as element i of a `dtype` buffer, and reads it back.
void Store(DataType dtype, void* data, size_t i, double value);
double Load(DataType dtype, const void* data, size_t i);

/// Fills `count` elements with InputValue(rank, offset + i, op).
void FillInput(DataType dtype, void* data, size_t count, int rank, ReduceOp op,
               size_t offset = 0);

/// Fills `count` elements with values that CountWrong(ranks, op, offset)
/// counts as wrong, one each (NaN for the floating types, the expected
/// value plus one for the integers): an output buffer filled so before a
/// checked call shows a call that wrote nothing.
void FillUnexpected(DataType dtype, void* data, size_t count, int ranks, ReduceOp op,
                    size_t offset = 0);

/// Counts elements that differ from ExpectedValue(ranks, offset + i, op);
/// the first mismatch is described in `first` when not null.
size_t CountWrong(DataType dtype, const void* data, size_t count, int ranks, ReduceOp op,
                  size_t offset = 0, std::string* first = nullptr);

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_EXPECTED_VALUES_H_
