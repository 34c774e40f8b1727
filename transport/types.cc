#include "transport/types.h"

namespace ddp::transport {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return 4;
    case DataType::kF64: return 8;
    case DataType::kF16: return 2;
    case DataType::kBF16: return 2;
    case DataType::kI32: return 4;
    case DataType::kI64: return 8;
    case DataType::kU8: return 1;
  }
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return "f32";
    case DataType::kF64: return "f64";
    case DataType::kF16: return "f16";
    case DataType::kBF16: return "bf16";
    case DataType::kI32: return "i32";
    case DataType::kI64: return "i64";
    case DataType::kU8: return "u8";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProd: return "prod";
  }
  return "unknown";
}

const char* AlgorithmName(Algorithm algo) {
  switch (algo) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kRhd: return "rhd";
    case Algorithm::kHierarchical: return "hierarchical";
    case Algorithm::kSharedMemory: return "shm";
  }
  return "unknown";
}

}  // namespace ddp::transport
