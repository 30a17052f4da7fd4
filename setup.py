"""The optional native decoding op (hf_qknorm/attention/_native.c); everything else is in pyproject.toml.

Where it cannot be built (no C compiler, no Python headers), the install goes on without it and the lean path runs its
ATen ops (hf_qknorm/attention/lean.py). -fno-trapping-math lets GCC vectorise the selects of its tanh and exp (the
op raises no floating-point exceptions anyone reads); no flag changes what a float operation computes."""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """``build_ext`` whose in-place copy (an editable install) lands by rename: a reinstall while tests or a training
    run have the op loaded replaces the file they mapped instead of rewriting it under them."""

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
            extra_compile_args=[] if sys.platform == "win32" else ["-O3", "-fno-trapping-math"],
            optional=True,
        )
    ],
)
