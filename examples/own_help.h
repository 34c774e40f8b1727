#ifndef DDP_EXAMPLES_OWN_HELP_H_
#define DDP_EXAMPLES_OWN_HELP_H_

namespace ddp::examples {

/// When argv asks for help (-h, -help, --help, --helpshort), prints the
/// usage message and the flags defined in `source` (a path without its
/// ".cc", e.g. "examples/ddp_hello") and returns true; the caller exits 0.
/// Called first in main: gflags' own --help lists the flags of every linked
/// library and exits 1, and a self-launching program would print it once
/// per rank.
bool ShowOwnHelpIfAsked(int argc, char** argv, const char* source);

}  // namespace ddp::examples

#endif  // DDP_EXAMPLES_OWN_HELP_H_
