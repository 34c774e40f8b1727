#ifndef DDP_TRANSPORT_ENV_VALUE_H_
#define DDP_TRANSPORT_ENV_VALUE_H_

// Strict parsing of the transport's environment variables (DDP_SHARED_MEMORY,
// DDP_SHM_STAGING_BYTES, ...): the whole value must parse, and anything else
// is an INVALID_ARGUMENT naming the variable, the value and what is
// accepted, so that a typo fails creation instead of silently meaning 0.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "transport/status.h"

namespace ddp::transport {

/// `name`'s value; "" when unset.
std::string GetEnv(const char* name);

/// A switch: 1, true, on, yes or 0, false, off, no, in any case.
StatusOr<bool> ParseEnvBool(std::string_view name, std::string_view value);

/// A byte count: decimal digits, optionally followed by K, M or G (either
/// case; KiB, MiB, GiB, powers of 1024), at most `max` bytes.
StatusOr<uint64_t> ParseEnvBytes(std::string_view name, std::string_view value, uint64_t max);

/// A count: decimal digits only, at most `max`.
StatusOr<uint64_t> ParseEnvCount(std::string_view name, std::string_view value, uint64_t max);

/// The same, read from the environment: nullopt when `name` is unset or empty.
StatusOr<std::optional<bool>> EnvBool(const char* name);
StatusOr<std::optional<uint64_t>> EnvBytes(const char* name, uint64_t max);
StatusOr<std::optional<uint64_t>> EnvCount(const char* name, uint64_t max);

}  // namespace ddp::transport

#endif  // DDP_TRANSPORT_ENV_VALUE_H_
