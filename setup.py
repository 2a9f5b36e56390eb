"""Build hook for the compiled Skan hot path; everything else is in pyproject.toml.

``pip install -e .`` (``make venv``) compiles ``wire/skan/_speedups.c`` with the
system C compiler.  The extension is optional at build time: without a
compiler the pure-Python codec is used (the test suite says so loudly).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "wire.skan._speedups",
            ["wire/skan/_speedups.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "broker._speedups",
            ["broker/_speedups.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
