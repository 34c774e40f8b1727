#include "nn/ops/autocast.h"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "nn/ops/functional.h"

namespace ddp::nn {

namespace {

// One cached cast of a parameter. The source is held weakly so the cache
// never keeps a parameter alive; storage and version detect SetData and
// in-place updates (an optimizer step) since the cast was made, and the
// view's geometry a SetData onto another view of the same storage.
struct CachedCast {
  std::weak_ptr<TensorImpl> source;
  const Storage* storage;
  uint64_t version;
  int64_t offset;
  Shape shape, strides;
  Tensor result;
};

struct CacheKey {
  const TensorImpl* impl;
  DType dtype;
  bool grad_mode;
  bool operator==(const CacheKey& o) const {
    return impl == o.impl && dtype == o.dtype && grad_mode == o.grad_mode;
  }
};

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    return std::hash<const void*>()(k.impl) * 31 + static_cast<size_t>(k.dtype) * 2 + (k.grad_mode ? 1 : 0);
  }
};

struct AutocastState {
  std::optional<DType> dtype;
  int enabled_depth = 0;  // enabled guards alive; the cache lives while > 0
  std::unordered_map<CacheKey, CachedCast, CacheKeyHash> cache;
};

thread_local AutocastState tls_state;

bool IsLowOrSingle(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

}  // namespace

std::optional<DType> AutocastDType() { return tls_state.dtype; }

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : prev_(tls_state.dtype), counted_(dtype.has_value()) {
  if (dtype && *dtype != DType::kFloat16 && *dtype != DType::kBFloat16) {
    throw std::invalid_argument("AutocastGuard: dtype must be f16 or bf16 (or nullopt to disable), got " +
                                std::string(DTypeName(*dtype)));
  }
  tls_state.dtype = dtype;
  if (counted_) ++tls_state.enabled_depth;
}

AutocastGuard::~AutocastGuard() {
  tls_state.dtype = prev_;
  if (counted_ && --tls_state.enabled_depth == 0) tls_state.cache.clear();
}

namespace ops::autocast {

namespace {

Tensor CastMaybeCached(const Tensor& x, DType dtype) {
  const bool cacheable = tls_state.enabled_depth > 0 && x.is_leaf() && x.requires_grad();
  if (!cacheable) return Cast(x, dtype);
  const CacheKey key{x.impl(), dtype, GradMode::IsEnabled()};
  auto it = tls_state.cache.find(key);
  if (it != tls_state.cache.end()) {
    const CachedCast& c = it->second;
    if (c.source.lock() == x.impl_ptr() && c.storage == x.storage().get() && c.version == x.storage()->version() &&
        c.offset == x.storage_offset() && c.shape == x.shape() && c.strides == x.strides()) {
      return c.result;
    }
  }
  Tensor result = Cast(x, dtype);
  tls_state.cache[key] = CachedCast{x.impl_ptr(), x.storage().get(), x.storage()->version(), x.storage_offset(),
                                    x.shape(), x.strides(), result};
  return result;
}

}  // namespace

Tensor ToLowPrecision(const Tensor& x) {
  const std::optional<DType> dtype = tls_state.dtype;
  if (!dtype || !x.defined() || x.dtype() == *dtype || !IsLowOrSingle(x.dtype())) return x;
  return CastMaybeCached(x, *dtype);
}

void CheckNoF64Mix(const char* op, const Tensor& input, const Tensor& weight) {
  const std::optional<DType> dtype = tls_state.dtype;
  if (!dtype || !input.defined() || !weight.defined()) return;
  if ((input.dtype() == DType::kFloat64) == (weight.dtype() == DType::kFloat64)) return;
  throw std::invalid_argument(std::string(op) + ": under autocast (" + std::string(DTypeName(*dtype)) +
                              ") the input is " + std::string(DTypeName(input.dtype())) + " and the weight " +
                              std::string(DTypeName(weight.dtype())) +
                              "; autocast leaves f64 alone and will not cast it to or from " +
                              std::string(DTypeName(*dtype)) + " (make both f64, or neither)");
}

Tensor ToFloat32(const Tensor& x) {
  if (!tls_state.dtype || !x.defined()) return x;
  if (x.dtype() != DType::kFloat16 && x.dtype() != DType::kBFloat16) return x;
  return Cast(x, DType::kFloat32);
}

size_t CachedCasts() { return tls_state.cache.size(); }

}  // namespace ops::autocast

}  // namespace ddp::nn
