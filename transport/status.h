#ifndef DDP_TRANSPORT_STATUS_H_
#define DDP_TRANSPORT_STATUS_H_

// Status and StatusOr<T>: the only error type of the transport's public API.
// A UCX status is converted to a Status in exactly one place
// (transport/ucx/ucx_status.cc); nothing above the transport sees UCX codes.

#include <cassert>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

namespace ddp::transport {

/// Error categories. Values are part of the stable API: append only.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,    ///< The caller passed something wrong.
  kTimedOut = 2,           ///< A deadline passed before the operation finished.
  kPeerLost = 3,           ///< A peer process died or its link went down.
  kUnavailable = 4,        ///< A service (store, network) cannot be reached.
  kInternal = 5,           ///< A bug or an unexpected library failure.
  kAborted = 6,            ///< The communicator was aborted earlier.
  kFailedPrecondition = 7, ///< The call is not valid in the current state.
  kNotFound = 8,           ///< A key or resource does not exist.
  kPermissionDenied = 9,   ///< Wrong job token or similar.
  kResourceExhausted = 10, ///< A size or memory bound was exceeded.
};

/// Returns "OK", "INVALID_ARGUMENT", "TIMED_OUT", ...
const char* StatusCodeName(StatusCode code);

/// An error code with a message; OK carries no message. Cheap to copy.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(code == StatusCode::kOk ? "" : std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// "TIMED_OUT: all-reduce step 3 waiting for rank 2 after 30000 ms".
  std::string ToString() const;

  /// Marks a status as deliberately unchecked.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

inline Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status TimedOutError(std::string m) { return {StatusCode::kTimedOut, std::move(m)}; }
inline Status PeerLostError(std::string m) { return {StatusCode::kPeerLost, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status AbortedError(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status FailedPreconditionError(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status PermissionDeniedError(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }

/// A value or an error. Accessing the value of an error aborts.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr built from an OK status without a value");
    if (status_.ok()) status_ = InternalError("StatusOr built from OK status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & { Check(); return *value_; }
  const T& value() const& { Check(); return *value_; }
  T&& value() && { Check(); return std::move(*value_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void Check() const;

  Status status_;
  std::optional<T> value_;
};

namespace internal {
[[noreturn]] void DieOnBadStatusOrAccess(const Status& status);
}  // namespace internal

template <typename T>
void StatusOr<T>::Check() const {
  if (!status_.ok()) internal::DieOnBadStatusOrAccess(status_);
}

}  // namespace ddp::transport

/// Returns from the enclosing function when `expr` (a Status) is not OK.
#define DDP_RETURN_IF_ERROR(expr)                                  \
  do {                                                             \
    ::ddp::transport::Status ddp_status_macro_ = (expr);           \
    if (!ddp_status_macro_.ok()) return ddp_status_macro_;         \
  } while (0)

#define DDP_STATUS_CONCAT_INNER_(a, b) a##b
#define DDP_STATUS_CONCAT_(a, b) DDP_STATUS_CONCAT_INNER_(a, b)

/// `DDP_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a StatusOr, or
/// returns its error from the enclosing function.
#define DDP_ASSIGN_OR_RETURN(lhs, expr)                                        \
  auto DDP_STATUS_CONCAT_(ddp_statusor_, __LINE__) = (expr);                   \
  if (!DDP_STATUS_CONCAT_(ddp_statusor_, __LINE__).ok())                       \
    return DDP_STATUS_CONCAT_(ddp_statusor_, __LINE__).status();               \
  lhs = std::move(DDP_STATUS_CONCAT_(ddp_statusor_, __LINE__)).value()

#endif  // DDP_TRANSPORT_STATUS_H_
