#include "tests/faults/injector.h"

#include <cxxabi.h>
#include <dirent.h>
#include <elf.h>
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

namespace ddp::faults {
namespace {

using transport::InternalError;
using transport::InvalidArgumentError;
using transport::NotFoundError;
using transport::Status;
using transport::StatusOr;
using transport::TimedOutError;
using transport::UnavailableError;

constexpr long kInt3 = 0xcc;
constexpr long kSyscall = 0x050f;  // bytes 0f 05, little-endian

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string Demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                             std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

std::vector<pid_t> Threads(pid_t pid) {
  std::vector<pid_t> tids;
  if (DIR* d = opendir(("/proc/" + std::to_string(pid) + "/task").c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') tids.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
    }
    closedir(d);
  }
  return tids;
}

// The tracer's view of the target's threads. Every ptrace call comes from
// the thread that made this object.
class Tracer {
 public:
  explicit Tracer(pid_t pid) : pid_(pid) {}

  ~Tracer() {
    // Anything still attached is let go as it is.
    for (pid_t tid : attached_) ptrace(PTRACE_DETACH, tid, nullptr, nullptr);
  }

  // Seizes every thread and stops them all.
  Status AttachAll() {
    for (bool added = true; added;) {
      added = false;
      for (pid_t tid : Threads(pid_)) {
        if (attached_.count(tid)) continue;
        if (ptrace(PTRACE_SEIZE, tid, nullptr, reinterpret_cast<void*>(PTRACE_O_TRACECLONE)) != 0) {
          if (errno == ESRCH) continue;  // the thread just exited
          return InternalError(Errno("ptrace(SEIZE) of thread " + std::to_string(tid)));
        }
        attached_.insert(tid);
        added = true;
        ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr);
        DDP_RETURN_IF_ERROR(WaitForStop(tid));
      }
    }
    if (attached_.empty()) return UnavailableError("process " + std::to_string(pid_) + " is gone");
    return Status::Ok();
  }

  // Resumes every stopped thread, passing on signals they were stopped for.
  void ContinueAll() {
    for (pid_t tid : attached_) {
      auto it = stopped_.find(tid);
      if (it == stopped_.end()) continue;
      ptrace(PTRACE_CONT, tid, nullptr, reinterpret_cast<void*>(static_cast<long>(it->second)));
      stopped_.erase(it);
    }
  }

  // Stops every running thread (threads created meanwhile included).
  Status StopAll() {
    for (bool more = true; more;) {
      more = false;
      for (pid_t tid : std::set<pid_t>(attached_)) {
        if (stopped_.count(tid)) continue;
        ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr);
        DDP_RETURN_IF_ERROR(WaitForStop(tid));
        more = true;
      }
    }
    return Status::Ok();
  }

  // Polls the threads for one event; returns the tid stopped by a trap at
  // `breakpoint`, 0 when nothing relevant happened, -1 when all are gone.
  pid_t Poll(uint64_t breakpoint) {
    if (attached_.empty()) return -1;
    for (pid_t tid : std::set<pid_t>(attached_)) {
      int status = 0;
      const pid_t r = waitpid(tid, &status, __WALL | WNOHANG);
      if (r == 0) continue;
      if (r < 0) {
        attached_.erase(tid);
        continue;
      }
      if (const pid_t hit = Handle(tid, status, breakpoint); hit > 0) return hit;
    }
    return attached_.empty() ? -1 : 0;
  }

  uint64_t ProgramCounter(pid_t tid) {
    user_regs_struct regs{};
    ptrace(PTRACE_GETREGS, tid, nullptr, &regs);
    return regs.rip;
  }

  Status SetRegisters(pid_t tid, const std::function<void(user_regs_struct&)>& edit) {
    user_regs_struct regs{};
    if (ptrace(PTRACE_GETREGS, tid, nullptr, &regs) != 0) return InternalError(Errno("GETREGS"));
    edit(regs);
    if (ptrace(PTRACE_SETREGS, tid, nullptr, &regs) != 0) return InternalError(Errno("SETREGS"));
    return Status::Ok();
  }

  StatusOr<long> Peek(uint64_t address) {
    errno = 0;
    const long word = ptrace(PTRACE_PEEKTEXT, pid_, reinterpret_cast<void*>(address), nullptr);
    if (errno != 0) return InternalError(Errno("PEEKTEXT"));
    return word;
  }

  // Through thread `via` (stopped; by default the main thread): ptrace
  // reaches memory only through a tracee in a ptrace stop.
  Status Poke(uint64_t address, long word, pid_t via = 0) {
    if (ptrace(PTRACE_POKETEXT, via > 0 ? via : pid_, reinterpret_cast<void*>(address),
               reinterpret_cast<void*>(word)) != 0) {
      return InternalError(Errno("POKETEXT"));
    }
    return Status::Ok();
  }

  // A thread whose int3 trap raced with our PTRACE_INTERRUPT reported the
  // interrupt first (job control stops come before signals) and still has
  // its SIGTRAP pending: detached, it would die of it. Resumes each such
  // thread into the signal's delivery stop, where the signal is dropped.
  // Call with the code restored and every thread stopped.
  Status DrainPendingTraps() {
    for (pid_t tid : std::set<pid_t>(attached_)) {
      if (!TrapPending(tid)) continue;
      if (ptrace(PTRACE_CONT, tid, nullptr, nullptr) != 0) return InternalError(Errno("CONT"));
      stopped_.erase(tid);
      DDP_RETURN_IF_ERROR(WaitForStop(tid));  // at once: the signal is pending
    }
    return Status::Ok();
  }

  // Detaches every (stopped) thread, leaving it to run.
  void DetachAll() {
    for (pid_t tid : attached_) ptrace(PTRACE_DETACH, tid, nullptr, nullptr);
    attached_.clear();
    stopped_.clear();
  }

  // Waits (bounded) until every thread has reported its end.
  void ReapAll() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!attached_.empty() && std::chrono::steady_clock::now() < until) {
      for (pid_t tid : std::set<pid_t>(attached_)) {
        int status = 0;
        const pid_t r = waitpid(tid, &status, __WALL | WNOHANG);
        if (r < 0 || (r > 0 && (WIFEXITED(status) || WIFSIGNALED(status)))) attached_.erase(tid);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    attached_.clear();
  }

  // Lets `tid`, stopped by the breakpoint at `address` (its pc one past
  // it), run the instruction the breakpoint replaced and go on, the
  // breakpoint set again behind it. Meanwhile (one instruction) other
  // threads pass the function without stopping.
  Status StepOver(pid_t tid, uint64_t address, long original) {
    DDP_RETURN_IF_ERROR(Poke(address, original, tid));
    DDP_RETURN_IF_ERROR(SetRegisters(tid, [&](user_regs_struct& r) { r.rip = address; }));
    stopped_.erase(tid);
    int pass_on = 0;  // a signal that arrived meanwhile, delivered after
    for (bool stepped = false; !stepped;) {
      if (ptrace(PTRACE_SINGLESTEP, tid, nullptr, nullptr) != 0) {
        if (errno == ESRCH) {
          attached_.erase(tid);
          return Rearm(address, original);
        }
        return InternalError(Errno("SINGLESTEP"));
      }
      for (;;) {
        int status = 0;
        const pid_t r = waitpid(tid, &status, __WALL);
        if (r < 0 || WIFEXITED(status) || WIFSIGNALED(status)) {
          attached_.erase(tid);
          return Rearm(address, original);
        }
        if (!WIFSTOPPED(status)) continue;
        const int event = status >> 16;
        if (event == PTRACE_EVENT_CLONE) AdoptClone(tid);
        const int sig = WSTOPSIG(status);
        if (event == 0 && sig == SIGTRAP && ProgramCounter(tid) != address) {
          stepped = true;
        } else if (event == 0 && sig != SIGTRAP && sig != SIGSTOP) {
          pass_on = sig;
        }
        break;
      }
    }
    DDP_RETURN_IF_ERROR(Poke(address, (original & ~0xffL) | kInt3, tid));
    if (ptrace(PTRACE_CONT, tid, nullptr, reinterpret_cast<void*>(static_cast<long>(pass_on))) != 0 &&
        errno != ESRCH) {
      return InternalError(Errno("CONT"));
    }
    return Status::Ok();
  }

  // Sets the breakpoint again once the thread that stepped over it ended
  // meanwhile: through the others, stopped for it.
  Status Rearm(uint64_t address, long original) {
    if (attached_.empty()) return Status::Ok();
    DDP_RETURN_IF_ERROR(StopAll());
    const pid_t via = *attached_.begin();
    DDP_RETURN_IF_ERROR(Poke(address, (original & ~0xffL) | kInt3, via));
    ContinueAll();
    return Status::Ok();
  }

  const std::set<pid_t>& threads() const { return attached_; }
  bool IsStopped(pid_t tid) const { return stopped_.count(tid) > 0; }

 private:
  // Blocks until `tid` stops (any stop) and records it.
  Status WaitForStop(pid_t tid) {
    for (;;) {
      int status = 0;
      const pid_t r = waitpid(tid, &status, __WALL);
      if (r < 0) {
        attached_.erase(tid);
        return Status::Ok();  // gone
      }
      if (WIFEXITED(status) || WIFSIGNALED(status)) {
        attached_.erase(tid);
        return Status::Ok();
      }
      if (WIFSTOPPED(status)) {
        const int event = status >> 16;
        if (event == PTRACE_EVENT_CLONE) AdoptClone(tid);
        // A signal that stopped it is delivered when it continues.
        const int sig = WSTOPSIG(status);
        stopped_[tid] = (event == 0 && sig != SIGTRAP && sig != SIGSTOP) ? sig : 0;
        if (event == 0 && sig == SIGTRAP) trapped_.insert(tid);
        return Status::Ok();
      }
    }
  }

  // SIGTRAP in the thread's own pending set (/proc's SigPnd).
  bool TrapPending(pid_t tid) const {
    std::ifstream status("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(tid) +
                         "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("SigPnd:", 0) == 0) {
        const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
        return (mask >> (SIGTRAP - 1)) & 1;
      }
    }
    return false;
  }

  void AdoptClone(pid_t tid) {
    unsigned long child = 0;
    if (ptrace(PTRACE_GETEVENTMSG, tid, nullptr, &child) == 0 && child != 0) {
      attached_.insert(static_cast<pid_t>(child));  // starts with an event stop
    }
  }

  pid_t Handle(pid_t tid, int status, uint64_t breakpoint) {
    if (WIFEXITED(status) || WIFSIGNALED(status)) {
      attached_.erase(tid);
      return 0;
    }
    if (!WIFSTOPPED(status)) return 0;
    const int sig = WSTOPSIG(status);
    const int event = status >> 16;
    if (event == PTRACE_EVENT_CLONE) {
      AdoptClone(tid);
      ptrace(PTRACE_CONT, tid, nullptr, nullptr);
      return 0;
    }
    if (event != 0) {  // an event stop (new thread, interrupt, group stop)
      ptrace(PTRACE_CONT, tid, nullptr, nullptr);
      return 0;
    }
    if (sig == SIGTRAP && ProgramCounter(tid) == breakpoint + 1) {
      stopped_[tid] = 0;
      return tid;
    }
    ptrace(PTRACE_CONT, tid, nullptr, reinterpret_cast<void*>(static_cast<long>(sig)));
    return 0;
  }

  pid_t pid_;
  std::set<pid_t> attached_;
  std::map<pid_t, int> stopped_;  // stopped threads and the signal to pass on
  std::set<pid_t> trapped_;
};

}  // namespace

const char* FaultActionName(FaultAction action) {
  switch (action) {
    case FaultAction::kKill: return "kill";
    case FaultAction::kStop: return "stop";
    case FaultAction::kExitZero: return "exit0";
  }
  return "?";
}

StatusOr<FunctionAddress> FindFunction(pid_t pid, const std::string& prefix) {
  const std::string proc = "/proc/" + std::to_string(pid);
  const std::string elf = ReadFile(proc + "/exe");
  if (elf.size() < sizeof(Elf64_Ehdr) || std::memcmp(elf.data(), ELFMAG, SELFMAG) != 0) {
    return UnavailableError("cannot read the executable of process " + std::to_string(pid));
  }
  Elf64_Ehdr eh;
  std::memcpy(&eh, elf.data(), sizeof(eh));
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_machine != EM_X86_64) {
    return InvalidArgumentError("only x86-64 ELF executables are supported");
  }
  const auto section = [&](size_t i) {
    Elf64_Shdr sh;
    std::memcpy(&sh, elf.data() + eh.e_shoff + i * sizeof(Elf64_Shdr), sizeof(sh));
    return sh;
  };
  std::vector<FunctionAddress> found;
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    const Elf64_Shdr symtab = section(i);
    if (symtab.sh_type != SHT_SYMTAB) continue;
    const Elf64_Shdr strtab = section(symtab.sh_link);
    for (size_t off = 0; off + sizeof(Elf64_Sym) <= symtab.sh_size; off += sizeof(Elf64_Sym)) {
      Elf64_Sym sym;
      std::memcpy(&sym, elf.data() + symtab.sh_offset + off, sizeof(sym));
      if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_value == 0) continue;
      const std::string name = Demangle(elf.data() + strtab.sh_offset + sym.st_name);
      if (name.rfind(prefix, 0) != 0 || name.find("[clone") != std::string::npos) continue;
      bool seen = false;
      for (const FunctionAddress& f : found) seen |= f.name == name;
      if (!seen) found.push_back({name, sym.st_value});
    }
  }
  if (found.empty()) {
    return NotFoundError("no function named " + prefix + "... in process " + std::to_string(pid));
  }
  if (found.size() > 1) {
    std::string all;
    for (const FunctionAddress& f : found) all += "\n  " + f.name;
    return InvalidArgumentError("several functions start with " + prefix + ":" + all);
  }
  FunctionAddress f = found.front();
  if (eh.e_type == ET_DYN) {
    // Position-independent: relocate by where the first segment was mapped.
    uint64_t first_vaddr = UINT64_MAX;
    for (size_t i = 0; i < eh.e_phnum; ++i) {
      Elf64_Phdr ph;
      std::memcpy(&ph, elf.data() + eh.e_phoff + i * sizeof(Elf64_Phdr), sizeof(ph));
      if (ph.p_type == PT_LOAD) first_vaddr = std::min<uint64_t>(first_vaddr, ph.p_vaddr & ~0xfffull);
    }
    char exe[4096];
    const ssize_t n = readlink((proc + "/exe").c_str(), exe, sizeof(exe) - 1);
    if (n <= 0) return UnavailableError(Errno("readlink " + proc + "/exe"));
    const std::string exe_path(exe, static_cast<size_t>(n));
    std::istringstream maps(ReadFile(proc + "/maps"));
    uint64_t base = 0;
    bool have_base = false;
    for (std::string line; std::getline(maps, line);) {
      std::istringstream fields(line);
      std::string range, perms, offset, dev, inode, path;
      fields >> range >> perms >> offset >> dev >> inode >> path;
      if (path == exe_path && std::strtoull(offset.c_str(), nullptr, 16) == 0) {
        base = std::strtoull(range.c_str(), nullptr, 16);
        have_base = true;
        break;
      }
    }
    if (!have_base) return UnavailableError("no mapping of " + exe_path + " in " + proc + "/maps");
    f.address = base - first_vaddr + f.address;
  }
  return f;
}

StatusOr<Injection> InjectAtFunction(pid_t pid, const std::string& prefix, FaultAction action,
                                     std::chrono::milliseconds timeout, int hit_number) {
  {
    // A tracer that is also the parent would reap the target's exit status
    // while waiting for its threads, and its own wait would never see it.
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos) {
      std::istringstream rest(text.substr(paren + 2));
      char state;
      pid_t parent = 0;
      rest >> state >> parent;
      if (parent == getpid()) {
        return InvalidArgumentError("process " + std::to_string(pid) +
                                    " is a child of the injecting process; start it through "
                                    "another process (a launcher or a shell)");
      }
    }
  }
  DDP_ASSIGN_OR_RETURN(FunctionAddress function, FindFunction(pid, prefix));
  const uint64_t address = function.address;
  Tracer tracer(pid);
  DDP_RETURN_IF_ERROR(tracer.AttachAll());
  DDP_ASSIGN_OR_RETURN(const long original, tracer.Peek(address));
  DDP_RETURN_IF_ERROR(tracer.Poke(address, (original & ~0xffL) | kInt3));
  tracer.ContinueAll();

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  pid_t hit = 0;
  int hits = 0;
  while (hit == 0) {
    hit = tracer.Poll(address);
    if (hit < 0) return UnavailableError("process " + std::to_string(pid) + " ended first");
    if (hit > 0 && ++hits < hit_number) {
      DDP_RETURN_IF_ERROR(tracer.StepOver(hit, address, original));
      hit = 0;
    }
    if (hit == 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        // Put the code back and let it go unharmed.
        DDP_RETURN_IF_ERROR(tracer.StopAll());
        for (pid_t tid : tracer.threads()) {
          if (tracer.ProgramCounter(tid) == address + 1) {
            DDP_RETURN_IF_ERROR(tracer.SetRegisters(tid, [&](user_regs_struct& r) { r.rip = address; }));
          }
        }
        DDP_RETURN_IF_ERROR(tracer.Poke(address, original));
        DDP_RETURN_IF_ERROR(tracer.DrainPendingTraps());
        tracer.DetachAll();
        return TimedOutError("no thread of process " + std::to_string(pid) + " reached " +
                             function.name + (hit_number > 1 ? " for the " + std::to_string(hit_number) +
                                                                   "th time (" + std::to_string(hits) + " hits)"
                                                             : std::string()) +
                             " within " + std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  Injection injection{function, std::chrono::steady_clock::now(), hit, hits};

  switch (action) {
    case FaultAction::kKill:
      kill(pid, SIGKILL);
      tracer.ReapAll();
      break;
    case FaultAction::kStop: {
      // Everything stopped, the code restored, threads that trapped moved
      // back to the instruction; then detached and stopped for good.
      DDP_RETURN_IF_ERROR(tracer.StopAll());
      for (pid_t tid : tracer.threads()) {
        if (tracer.ProgramCounter(tid) == address + 1) {
          DDP_RETURN_IF_ERROR(tracer.SetRegisters(tid, [&](user_regs_struct& r) { r.rip = address; }));
        }
      }
      DDP_RETURN_IF_ERROR(tracer.Poke(address, original));
      DDP_RETURN_IF_ERROR(tracer.DrainPendingTraps());
      kill(pid, SIGSTOP);  // pending: takes effect as the threads are released
      tracer.DetachAll();
      break;
    }
    case FaultAction::kExitZero: {
      // Only the thread at the breakpoint runs again, straight into
      // exit_group(0); the others never do.
      DDP_RETURN_IF_ERROR(tracer.StopAll());
      DDP_RETURN_IF_ERROR(tracer.Poke(address, (original & ~0xffffL) | kSyscall));
      DDP_RETURN_IF_ERROR(tracer.SetRegisters(hit, [&](user_regs_struct& r) {
        r.rip = address;
        r.rax = SYS_exit_group;
        r.orig_rax = static_cast<unsigned long long>(-1);
        r.rdi = 0;
      }));
      ptrace(PTRACE_CONT, hit, nullptr, nullptr);
      tracer.ReapAll();
      break;
    }
  }
  return injection;
}

}  // namespace ddp::faults
