"""cuda_library: compiles .cu files with nvcc and wraps the objects in a
cc_library. Active only under --config=cuda; in a plain build the target is
incompatible and `bazel build //...` skips it, so nothing needs CUDA.

Kernels are built for sm_90 (H100/H200) and sm_80 (A100), with PTX for
sm_90 so newer GPUs can JIT them.
"""

load("//tools/bazel:defs.bzl", "CUDA_ONLY")

NVCC = "/usr/local/cuda/bin/nvcc"

NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wall",
    "-Werror=all-warnings",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
    "-isystem",
    "/usr/local/cuda/include",
    "-I.",
]

def cuda_library(name, srcs, hdrs = [], cu_deps = [], deps = [], nvcc_flags = [], **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files (and private .cuh headers).
      hdrs: public headers (C++ host API of the kernels).
      cu_deps: header-only files or filegroups the .cu files include.
      deps: cc_library dependencies for the host side.
      nvcc_flags: extra nvcc flags.
      **kwargs: passed to the cc_library.
    """
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    private_hdrs = [s for s in srcs if not s.endswith(".cu")]
    objs = []
    for src in cu_srcs:
        stem = src[:-len(".cu")].replace("/", "_")
        obj = "_cuda_objs/%s/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + private_hdrs + cu_deps,
            outs = [obj],
            cmd = " ".join([NVCC] + NVCC_FLAGS + nvcc_flags + [
                "-I$(GENDIR)",
                "-c",
                "$(location %s)" % src,
                "-o",
                "$@",
            ]),
            target_compatible_with = CUDA_ONLY,
            tags = ["cuda"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        target_compatible_with = CUDA_ONLY,
        linkstatic = True,
        **kwargs
    )
