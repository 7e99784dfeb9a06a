"""Build of attnserve's ONNX Runtime kernels (attnserve/kernels/csrc/: one file per op family,
the SIMD helpers, the thread pool, ONNX Runtime's ABI and the registration); everything else
about the package is in pyproject.toml.

The library is optional: without a C++ compiler the install still succeeds, and the exported
graphs run their ops' stock bodies (attnserve/kernels/functions.py)."""

from setuptools import Extension, setup

CSRC = "attnserve/kernels/csrc"
# Every file of CSRC, listed (tests/kernels/test_build.py checks the lists against the folder).
SOURCES = [
    "attention.cc",  # AttnScores, AttnMix and their half-cache forms
    "blockquant.cc",  # BlockQ4MatMul, BlockQ8MatMul
    "causal_attention.cc",  # CausalGroupAttention
    "elementwise.cc",  # AddRMSNorm, SwiGLU
    "ort_glue.cc",  # inputs, outputs, failures, the threads a kernel's tasks run on
    "pool.cc",  # the kernels' own threads
    "qmatmul.cc",  # QMatMul, QMatMulBias, PackedQMatMul[Bias], RowQMatMul
    "registration.cc",  # the ops ONNX Runtime registers, the exported functions
    "rowquant.cc",  # RowQuantize
    "vocab.cc",  # LogSoftmaxTopK
]
HEADERS = [
    "attention.h",
    "ops.h",
    "ort_abi.h",
    "ort_glue.h",
    "pool.h",
    "rowquant.h",
    "simd.h",
]

setup(
    ext_modules=[
        Extension(
            "attnserve.kernels._ortops",
            sources=[f"{CSRC}/{name}" for name in SOURCES],
            depends=[f"{CSRC}/{name}" for name in HEADERS],
            extra_compile_args=[
                "-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off", "-pthread"
            ],
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,
        )
    ]
)
