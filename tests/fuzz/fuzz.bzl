"""ddp_fuzzer: one fuzz target, three ways to run it.

A fuzz target is a source file that defines LLVMFuzzerTestOneInput. The macro
makes from it:

  <name>          under --config=fuzz: a libFuzzer binary (clang, ASan, UBSan,
                  coverage), for long runs by hand:
                      bazel run --config=fuzz //tests/fuzz:<name> -- \\
                          -max_total_time=600 $PWD/tests/fuzz/corpus/<corpus>
                  under the default config: a replay driver that runs the
                  files and folders it is given (and --mutations=N).
  <name>_test     a test in every config (plain gcc in CI): replays the seed
                  corpus in tests/fuzz/corpus/<corpus>/ and then `mutations`
                  deterministic mutants of it.

The fuzz target never knows which driver runs it.
"""

load("//tools/bazel:defs.bzl", "ddp_cc_binary", "ddp_cc_test")

def ddp_fuzzer(name, srcs, corpus, deps = [], mutations = 4000, size = "small", **kwargs):
    corpus_files = native.glob(["corpus/%s/*" % corpus])
    ddp_cc_binary(
        name = name,
        srcs = srcs,
        deps = deps + ["//tests/fuzz:fuzz_target"] + select({
            "//tests/fuzz:fuzz_enabled": [],
            "//conditions:default": ["//tests/fuzz:replay_main"],
        }),
        linkopts = select({
            "//tests/fuzz:fuzz_enabled": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        testonly = True,
        **kwargs
    )
    ddp_cc_test(
        name = name + "_test",
        size = size,
        srcs = srcs,
        data = corpus_files,
        args = [
            "--corpus=tests/fuzz/corpus/%s" % corpus,
            "--mutations=%d" % mutations,
        ],
        main = False,
        deps = deps + [
            "//tests/fuzz:corpus_test_main",
            "//tests/fuzz:fuzz_target",
        ],
        **kwargs
    )
