"""Build of the native suffix index (tailrl/spec/_suffix_index.cpp); metadata is in pyproject.toml.

``optional=True``: without a C++ compiler the install still succeeds and tailrl drafts with
the pure-Python reference index (slower; ``tailrl.spec.suffix_index.NATIVE`` is False).
"""
import pybind11
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "tailrl.spec._suffix_index", ["tailrl/spec/_suffix_index.cpp"],
    include_dirs=[pybind11.get_include()], language="c++",
    extra_compile_args=["-O2", "-std=c++17"], optional=True)])
