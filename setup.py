"""Build hook for the compiled Skan hot path; everything else is in pyproject.toml.

``pip install -e .`` (``make venv``) compiles ``wire/skan/_codec_speedups.c`` with the
system C compiler.  The extension is optional at build time: without a
compiler the pure-Python codec is used (the test suite says so loudly).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "wire.skan._codec_speedups",
            ["wire/skan/_codec_speedups.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "broker.serving._held_io",
            ["broker/serving/_held_io.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "broker._observer_speedups",
            ["broker/_observer_speedups.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
