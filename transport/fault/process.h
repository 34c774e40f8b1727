#ifndef DDP_TRANSPORT_FAULT_PROCESS_H_
#define DDP_TRANSPORT_FAULT_PROCESS_H_

namespace ddp::transport::fault {

/// Whether process `pid` of this host is gone for a peer's purposes: no
/// such process, a zombie (exited, not yet reaped by its parent, which for
/// a rank is its launcher), or past releasing its memory on the way out.
/// For when no pidfd can be had (kernels before 5.3, seccomp, every
/// descriptor in use): it needs no descriptor, since a process without
/// memory has no /proc/PID/exe to read. kill(pid, 0) alone takes a zombie
/// for alive.
bool ProcessGoneNow(int pid);

}  // namespace ddp::transport::fault

#endif  // DDP_TRANSPORT_FAULT_PROCESS_H_
