"""The C part of indexcore: everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "indexcore._kernels",
            ["indexcore/_kernels.c"],
            libraries=["z"],  # zlib's crc32 for short bodies and CPUs without carry-less multiply
            extra_compile_args=["-O3", "-std=c11", *WARNINGS],
        ),
        # byte spans of many records at once, for columnar consumers (the backfill's catalog)
        Extension("indexcore._spans", ["indexcore/_spans.c"], extra_compile_args=["-O3", "-std=c11", *WARNINGS]),
    ]
)
