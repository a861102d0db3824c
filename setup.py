"""The C part of indexcore: everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexcore._kernels",
            ["indexcore/_kernels.c"],
            libraries=["z"],  # zlib's crc32, the one Python's zlib module wraps
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    ]
)
