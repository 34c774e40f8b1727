#ifndef DDP_TRANSPORT_FAULT_PROCESS_H_
#define DDP_TRANSPORT_FAULT_PROCESS_H_

#include <cstdint>

namespace ddp::transport::fault {

/// When process `pid` of this host started, in clock ticks since boot
/// (field 22 of /proc/PID/stat); 0 when it cannot be read (no such
/// process). A pid names one process for as long as this stays the same.
uint64_t ProcessStartTime(int pid);

/// Clock ticks since boot now, on the clock ProcessStartTime counts in
/// (CLOCK_BOOTTIME in units of sysconf(_SC_CLK_TCK)); 0 when it cannot be
/// read. Needs no descriptor. A process whose start time is later started
/// after this call.
uint64_t TicksSinceBoot();

/// The state letter of process `pid` of this host (field 3 of
/// /proc/PID/stat: R, S, D, T, t, Z, X...); 0 when there is no such
/// process or /proc cannot be read.
char ProcessState(int pid);

/// Whether process `pid` of this host is gone for a peer's purposes: no
/// such process, a zombie (exited, not yet reaped by its parent, which for
/// a rank is its launcher), or past releasing its memory on the way out.
/// For when no pidfd can be had (kernels before 5.3, seccomp, every
/// descriptor in use): it needs no descriptor, since a process without
/// memory has no /proc/PID/exe to read. kill(pid, 0) alone takes a zombie
/// for alive. A process whose main thread exited (pthread_exit) while its
/// other threads run on is not gone, though the kernel shows it alike.
/// With `start_time` (ProcessStartTime when the process was first seen;
/// 0: unknown), a process now under `pid` that started at another time is
/// another process (the pid was reused), and the one watched is gone.
/// A pid of 0 or below names no process: gone, without asking the kernel
/// (kill() would take it for a process group, or for every process).
bool ProcessGoneNow(int pid, uint64_t start_time = 0);

}  // namespace ddp::transport::fault

#endif  // DDP_TRANSPORT_FAULT_PROCESS_H_
