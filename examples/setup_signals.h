#ifndef DDP_EXAMPLES_SETUP_SIGNALS_H_
#define DDP_EXAMPLES_SETUP_SIGNALS_H_

#include <string>
#include <vector>

namespace ddp::examples {

/// Ctrl-C (SIGINT), SIGTERM and SIGHUP while a self-launching program checks
/// its flags, data and paths, before it starts any rank. Their default
/// action ended it printing nothing; from this call on, the first one prints
/// "<program>: interrupted by Ctrl-C during setup; stopping before any rank
/// starts (Ctrl-C again: at once)" at once, and the process ends by that
/// signal at the next StopIfInterruptedInSetup, once the check under way has
/// returned (none is cut short halfway, leaving a probe file behind, say;
/// only a wait that leaves nothing, such as a --flagfile read from a
/// stream, gives way at once: see InterruptedInSetup).
/// The same signal again ends it at once. A signal found ignored (nohup) stays
/// ignored. Called once, in the process that would start the ranks only (a
/// rank's signals are its launcher's business).
void WatchSetupSignals(const char* program);

/// Puts back the actions WatchSetupSignals found; called before the ranks
/// start, since the launcher puts its own handlers in place (it forwards the
/// signals to them).
void EndSetupSignals();

/// Ends the process by the signal taken since WatchSetupSignals, if any (its
/// line said already), as that signal ends it by default; else returns.
/// Before it ends the process, it removes the folders given to
/// RemoveIfInterruptedInSetup.
void StopIfInterruptedInSetup();

/// Whether a signal was taken since WatchSetupSignals (its line said
/// already). Async-signal-safe to read. A wait in setup with a long deadline
/// of its own (a --flagfile read from a stream: up to 120 s) looks at it
/// between short slices and gives way at once, through
/// StopIfInterruptedInSetup(cut_short).
bool InterruptedInSetup();

/// StopIfInterruptedInSetup, saying first "<program>: <cut_short>" on
/// stderr (what the signal left undone, e.g. a --flagfile not read to its
/// end) when it ends the process; else returns, saying nothing.
void StopIfInterruptedInSetup(const std::string& cut_short);

/// Folders the setup made (outermost first, none that was there before),
/// which StopIfInterruptedInSetup removes, deepest first and each only
/// while it is empty, before it ends the process: a run stopped before any
/// rank started would leave them empty (a --log_dir, a checkpoint's
/// folder). Adds to those given before.
void RemoveIfInterruptedInSetup(const std::vector<std::string>& folders);

/// EndSetupSignals, then StopIfInterruptedInSetup: once the last check
/// before the ranks start has returned (in SelfLaunchOptions::
/// check_arguments). In this order, a signal after it ends the process by
/// its own action, never taken and left undone.
void EndSetup();

}  // namespace ddp::examples

#endif  // DDP_EXAMPLES_SETUP_SIGNALS_H_
