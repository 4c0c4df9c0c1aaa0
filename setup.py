"""Build of the native parts; metadata is in pyproject.toml.

- ``tailrl.speculative.sources._suffix_index`` (``_suffix_index.cpp``): the suffix index drafts come from.
- ``tailrl.kernels._attention`` (``_attention.cpp``): row attention for decode, verify and
  prefill steps (OpenMP; torch's own libgomp is the one loaded at run time).
- ``tailrl.kernels._gemm`` (``_gemm.cpp``): the row-invariant bfloat16 matmul (OpenMP).

All are ``optional=True``: without a C++ compiler the install still succeeds and tailrl uses
the pure-Python references (slower; ``tailrl.speculative.sources.suffix_index.NATIVE`` and
``tailrl.kernels.cpu.NATIVE`` / ``NATIVE_GEMM`` tell which is in use). ``TAILRL_PORTABLE_BUILD=1``
compiles for any x86-64 instead of this machine's instruction set (e.g. a shared install
used by machines of several kinds).
"""
import os

import pybind11
from setuptools import Extension, setup

ARCH = [] if os.environ.get("TAILRL_PORTABLE_BUILD") else ["-march=native"]

setup(ext_modules=[
    Extension("tailrl.speculative.sources._suffix_index", ["tailrl/speculative/sources/_suffix_index.cpp"],
              include_dirs=[pybind11.get_include()], language="c++",
              extra_compile_args=["-O2", "-std=c++17"], optional=True),
    Extension("tailrl.kernels._attention", ["tailrl/kernels/_attention.cpp"],
              depends=["tailrl/kernels/_attention_bf16.h"], include_dirs=[pybind11.get_include()], language="c++",
              # no FP traps assumed: the branch-free exp's clamp vectorises (act_mul, softmax); no
              # result changes (no reassociation, no contraction other than the default's)
              extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math", *ARCH],
              extra_link_args=["-fopenmp"], optional=True),
    Extension("tailrl.kernels._gemm", ["tailrl/kernels/_gemm.cpp"], include_dirs=[pybind11.get_include()],
              language="c++", extra_compile_args=["-O3", "-std=c++17", "-fopenmp", *ARCH],
              extra_link_args=["-fopenmp"], optional=True),
])
