#ifndef DDP_EXAMPLES_OWN_HELP_H_
#define DDP_EXAMPLES_OWN_HELP_H_

#include <chrono>
#include <string>
#include <vector>

namespace ddp::examples {

/// When argv asks for help (-h, -help, --help, --helpshort, or one of these
/// with a true value: --help=true), prints the usage message and the flags
/// defined in `source` (a path without its ".cc", e.g. "examples/ddp_hello")
/// and returns true; the caller exits 0. Called first in main: gflags' own
/// --help lists the flags of every linked library and exits 1, and a
/// self-launching program would print it once per rank.
bool ShowOwnHelpIfAsked(int argc, char** argv, const char* source);

/// What is wrong with the first flag in argv that gflags would refuse, in
/// one line for "<program>: <line>" and exit status 2, or "": a flag no
/// linked library defines ("unknown flag --modle; did you mean --model?
/// (--help lists the flags)", suggesting a flag of `source` at most two
/// edits away), a value not of its flag's type ("--seed=-1: the flag takes
/// a whole number, at least 0"; "--help=foo: the flag takes true or
/// false"), or of its type but past its range ("--workers=99999999999 is out
/// of range: the flag takes a whole number from -2147483648 to
/// 2147483647"); such values are set, as parsing sets them next (strings of
/// other files, such as gflags' own, are left alone). Or a flag missing its
/// value ("--helpon needs a value: --helpon=VALUE"), a --flagfile (gflags'
/// own) that names a file that cannot be read or a folder ("--flagfile=x:
/// cannot read x (No such file or directory)"), a flag inside such a file
/// (read as gflags reads it: one flag a line, "#" comments, sections for
/// other programs, nested --flagfile) that is wrong in any of these ways,
/// named with its file and line ("flags.txt:3: unknown flag --modle; did
/// you mean --model? ..."; gflags ignored an unknown one there without a
/// word; a FIFO or other file that is not a regular one is left to gflags,
/// since reading it would take what it holds: see InlineStreamFlagfiles),
/// or a --fromenv/--tryfromenv
/// (gflags' own) that names an unknown flag, a variable FLAGS_<flag> that is
/// unset (--fromenv) or a value its flag refuses ("--fromenv=seed:
/// FLAGS_seed=-1: the flag takes ..."). gflags' own messages for these
/// ("ERROR: unknown command line flag 'modle'") name no program and exit 1.
/// What gflags accepts passes: a value after its flag, --noBOOL, a negative
/// value, anything after "--", a flag --undefok names, gflags' help flags
/// that print what they ask for (--helpfull, --helpon=FILE, ...), and
/// --nproc_per_node (or --nproc-per-node), which SelfLaunchOrExit takes in
/// programs without such a gflags flag; since it takes them with two dashes
/// only, one dash (-nproc_per_node=2) is refused, naming the spelling it
/// takes. A program that starts no ranks passes `no_launcher`, the reason
/// it refuses --nproc_per_node in any spelling, on the command line or in
/// a --flagfile ("--nproc_per_node=2: " followed by it).
std::string FlagProblem(int argc, char** argv, const char* source, const char* no_launcher = nullptr);

/// Called before FlagProblem, on argv (argv[0] first): puts in the place of
/// each --flagfile on the command line that is a stream (a FIFO such as a
/// shell's <(...), /dev/stdin, a terminal: neither a regular file nor a
/// folder) the flags it holds for this program, one argument a line, as
/// gflags would read them from it; a regular file named beside it in the
/// same --flagfile=A,B stays there. A stream is read once, to its end:
/// FlagProblem then checks the flags that gflags sets, and a self-launching
/// program's ranks, started with these arguments, get them too (from the
/// stream they would get nothing, or wait on it). Returns what is wrong
/// with a line of one, named with its path and line as FlagProblem names
/// them ("/dev/fd/63:2: unknown flag --modle; ..."), one that cannot be
/// read, or one named twice; else "". A stream named inside a file of flags
/// is left to gflags. A stream must end (its writer close it) within
/// `stream_wait` and hold at most 1 MiB, else that is the problem named.
/// A signal taken in setup (WatchSetupSignals) while a stream is read ends
/// the process within a tenth of a second, by that signal, after the line
/// "<program>: --flagfile=PATH: stopped reading PATH before its end ..."
/// (StopIfInterruptedInSetup): Ctrl-C's line says it stops, and the rest of
/// `stream_wait` is not waited out.
std::string InlineStreamFlagfiles(std::vector<std::string>& args, const char* source,
                                  const char* no_launcher = nullptr,
                                  std::chrono::milliseconds stream_wait = std::chrono::seconds(120));

/// InlineStreamFlagfiles on main's `argc` and `argv`, which then give the
/// result (kept until the process ends), then FlagProblem on them: the
/// first problem found, or "". A double flag's value there that is a
/// decimal number below the smallest normal double (--lr=1e-310, or
/// 1e-400, which is 0), which gflags refuses though it is a valid double,
/// is written in the result as the same double in exact hexadecimal
/// (0x1.7024c96ca3ce4p-1030), which gflags reads; in a file of flags or
/// the environment, which gflags reads itself, FlagProblem refuses it
/// naming that spelling. Called once, before gflags parses (and after
/// WatchSetupSignals where the program calls it: a stream may take its
/// time).
std::string CommandLineProblem(int* argc, char*** argv, const char* source, const char* no_launcher = nullptr);

}  // namespace ddp::examples

#endif  // DDP_EXAMPLES_OWN_HELP_H_
