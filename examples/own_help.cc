#include "examples/own_help.h"

#include <gflags/gflags.h>

#include <string_view>

namespace ddp::examples {

bool ShowOwnHelpIfAsked(int argc, char** argv, const char* source) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help" || arg == "-help" || arg == "--helpshort") {
      gflags::ShowUsageWithFlagsRestrict(argv[0], source);
      return true;
    }
  }
  return false;
}

}  // namespace ddp::examples
