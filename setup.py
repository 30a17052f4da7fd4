"""The optional native op (hf_qknorm/attention/_native.c); everything else is in pyproject.toml.

It needs GCC or Clang (the loops use their vector extensions) and Python's headers. Where it cannot be built -- another
compiler, no compiler, no headers -- the install prints one line saying so and goes on without it, and every path runs
its ATen ops (hf_qknorm/attention/native.py; `hf-qknorm info` says which). -fno-trapping-math lets the compilers
vectorise the selects of its tanh and exp (the op raises no floating-point exceptions anyone reads); no flag changes
what a float operation computes; -Wno-psabi quiets a note on the vector type's calling convention, which
only the file's own static functions use."""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NOT_BUILT = "hf_qknorm: the native CPU op (_native.c) is not built ({}); the package runs its PyTorch ops instead"


class BuildExt(build_ext):
    """``build_ext`` that says in one line why the op is not built, and whose in-place copy (an editable install)
    lands by rename: a reinstall while tests or a training run have the op loaded replaces the file they mapped
    instead of rewriting it under them."""

    def build_extension(self, ext):
        kind = getattr(self.compiler, "compiler_type", "")
        if kind not in ("unix", "mingw32", "cygwin"):
            print(NOT_BUILT.format(f"it needs GCC or Clang, the compiler here is {kind or 'unknown'}"), file=sys.stderr)
            return
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001 - any failure to compile or link: the op is optional
            program = (getattr(self.compiler, "compiler_so", None) or ["the compiler"])[0]
            print(NOT_BUILT.format(f"{program} failed: {type(error).__name__}"), file=sys.stderr)

    def copy_file(self, infile, outfile, *args, **kwargs):
        partial = f"{outfile}.{os.getpid()}.partial"
        try:
            super().copy_file(infile, partial, *args, **kwargs)
            os.replace(partial, outfile)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return outfile, 1


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "hf_qknorm.attention._native",
            ["hf_qknorm/attention/_native.c"],
            extra_compile_args=["-O3", "-fno-trapping-math", "-Wno-psabi"],
            optional=True,
        )
    ],
)
