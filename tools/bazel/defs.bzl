"""Build macros shared by every package, so that all project code compiles
with the same flags: C++20 (from .bazelrc), warnings on and fatal.

Use ddp_cc_library / ddp_cc_binary / ddp_cc_test instead of the native rules
for the project's own code; third-party code keeps its own flags.
"""

# -Werror applies to the project's own code only: system headers come in as
# -isystem and never warn.
DDP_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-sign-compare",
    "-Wno-missing-field-initializers",
]

# Constrains a target to builds with --config=cuda; elsewhere `bazel build
# //...` skips it instead of failing.
CUDA_ONLY = select({
    "//tools/bazel:cuda_enabled": [],
    "//conditions:default": ["//tools/bazel:incompatible"],
})

def if_cuda(if_true, if_false = []):
    """Returns if_true under --config=cuda, otherwise if_false."""
    return select({
        "//tools/bazel:cuda_enabled": if_true,
        "//conditions:default": if_false,
    })

def ddp_cc_library(name, copts = [], **kwargs):
    native.cc_library(name = name, copts = DDP_COPTS + copts, **kwargs)

def ddp_cc_binary(name, copts = [], **kwargs):
    native.cc_binary(name = name, copts = DDP_COPTS + copts, **kwargs)

def ddp_cc_test(name, copts = [], deps = [], data = [], main = True, **kwargs):
    """A GoogleTest test. main=False when the test brings its own main()."""
    native.cc_test(
        name = name,
        copts = DDP_COPTS + copts,
        deps = deps + (["@gtest//:gtest_main"] if main else ["@gtest"]),
        data = data + ["//tools/sanitizers:suppressions"],
        **kwargs
    )
