#ifndef DDP_TRANSPORT_TESTING_COLLECTIVE_VALUES_H_
#define DDP_TRANSPORT_TESTING_COLLECTIVE_VALUES_H_

// Inputs and closed-form results for collective tests. Rank r contributes
// Contribution(op, dtype, r, i) at element i; the values are small integers
// (sums of -2..2, products of -1, 1 and 2) so that every partial result is
// exact in every dtype, bf16 included, whatever order an algorithm reduces
// in: results are compared bit for bit. Being exact, they cannot show an
// algorithm whose ranks reduce in different orders; the all-reduce tests'
// SweepRandomValues (transport/algorithms/all_reduce_test_util.h) does.

#include <cstddef>
#include <string>
#include <vector>

#include "transport/types.h"

namespace ddp::transport::testing {

/// Rank `rank`'s value at element `i` (as a double; Store encodes it).
double Contribution(ReduceOp op, DataType dtype, int rank, size_t i);

/// The all-reduce result at element `i` over ranks 0..world-1, including
/// kAvg's division in the dtype's own arithmetic.
double Expected(ReduceOp op, DataType dtype, int world, size_t i);

/// Writes `value` as element `i` of a `dtype` buffer (rounded to nearest).
void Store(DataType dtype, void* buf, size_t i, double value);
/// Element `i` of a `dtype` buffer as a double.
double Load(DataType dtype, const void* buf, size_t i);

/// `count` elements: Contribution(op, dtype, rank, first + j) at j.
std::vector<unsigned char> Contributions(ReduceOp op, DataType dtype, int rank, size_t count,
                                         size_t first = 0);
/// `count` elements: Expected(op, dtype, world, first + j) at j.
std::vector<unsigned char> Expectations(ReduceOp op, DataType dtype, int world, size_t count,
                                        size_t first = 0);

/// "" when `got` equals `want` bit for bit over `count` elements, else the
/// first differing element with both values and how many differ.
std::string Compare(DataType dtype, const void* got, const void* want, size_t count);

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_COLLECTIVE_VALUES_H_
