"""Build of attnserve's ONNX Runtime kernels (attnserve/kernels/ortops.cc); everything else about
the package is in pyproject.toml.

The library is optional: without a C++ compiler the install still succeeds, and the exported
graphs run their attention products as stock ONNX (attnserve/kernels/__init__.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "attnserve.kernels._ortops",
            sources=["attnserve/kernels/ortops.cc"],
            depends=["attnserve/kernels/ort_abi.h"],
            extra_compile_args=[
                "-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off", "-pthread"
            ],
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,
        )
    ]
)
