#ifndef DDP_TRANSPORT_LAUNCH_ERROR_FILE_H_
#define DDP_TRANSPORT_LAUNCH_ERROR_FILE_H_

// Error files, torchrun's way for a worker to tell its launcher why it
// failed. The launcher (ddprun, SelfLaunch, torchrun) gives every worker a
// path of its own in TORCHELASTIC_ERROR_FILE; a worker about to fail writes
// the reason there, and the launcher's report of the failure carries it (a
// log file or a terminal the user does not watch no longer hides it).
//
// The file is JSON in torchrun's layout, so PyTorch programs decorated with
// torch.distributed.elastic's @record report through ddprun, and our
// programs through torchrun:
//
//   {"message": {"message": "<why>",
//                "extraInfo": {"timestamp": "<unix seconds>",
//                              "timestamp_us": "<unix microseconds>"}}}
//
// A reader also takes the older form {"message": "<why>", "timestamp": N}.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "transport/status.h"

namespace ddp::transport::launch {

/// The variable that names a worker's error file.
inline constexpr char kEnvErrorFile[] = "TORCHELASTIC_ERROR_FILE";

/// What a worker wrote before it failed.
struct WorkerError {
  std::string message;
  /// Unix time in microseconds (whole seconds for files that give only
  /// those); 0 when the file gave none. The launcher reports the earliest.
  int64_t timestamp_us = 0;
  /// The whole file as written (with a PyTorch @record: the traceback in
  /// extraInfo.py_callstack, the error's name), for CopyErrorRecord.
  std::string record;
};

/// Writes `message` to `path` whole or not at all (a temporary file renamed
/// over it), stamped with `when`.
Status WriteErrorFile(const std::string& path, std::string_view message,
                      std::chrono::system_clock::time_point when = std::chrono::system_clock::now());

/// torchrun's way of passing the root-cause worker's error up (its
/// ErrorHandler.dump_error_file, which its @record-decorated main calls
/// with the worker's exit code): `record`, a file ReadErrorFile read, is
/// written to `path` whole or not at all, keeping everything the worker
/// wrote (a PyTorch program's traceback in extraInfo.py_callstack), with
/// "errorCode" in its "message" object set to `error_code` (the worker's
/// exit code, or minus the signal that killed it) unless that is 0 or the
/// message is a plain string. INVALID_ARGUMENT when `record` is not JSON.
Status CopyErrorRecord(const std::string& path, const std::string& record, int error_code);

/// For a worker about to exit with a failure: writes `message` to the file
/// its launcher named in TORCHELASTIC_ERROR_FILE. OK and nothing written
/// when the variable is unset or empty (no launcher asked).
Status RecordWorkerError(std::string_view message);

/// Reads an error file. NOT_FOUND when there is none; INVALID_ARGUMENT,
/// naming the path, when it is not a regular file (a FIFO is refused at
/// once, never waited on) or not the JSON described above (or over 1 MiB);
/// INTERNAL when it cannot be read (no descriptors left, EIO).
StatusOr<WorkerError> ReadErrorFile(const std::string& path);

}  // namespace ddp::transport::launch

#endif  // DDP_TRANSPORT_LAUNCH_ERROR_FILE_H_
