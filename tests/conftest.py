import os
import sys

import pytest
import torch

if not torch.cuda.is_available():                      # the Triton kernels run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # every lane is a program the interpreter runs in Python: two lanes keep the engine tests'
    # time (test_attention_lanes_... checks the default's 16)
    os.environ.setdefault("TAILRL_ATTENTION_LANES", "2")

sys.path.insert(0, os.path.dirname(__file__))          # tests/checkpoints.py
from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Factory: a cached random checkpoint per (arch, options)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("ckpts")

    def get(arch: str = "qwen2", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_checkpoint(str(root / f"{arch}_{len(cache)}"), arch, **kw)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def model(ckpt_dir):
    """A random target with sharp next-token distributions (drafts get both accepted and
    rejected); test modules that need another define their own ``model``."""
    return ckpt_dir("qwen2", init_std=3.0, max_pos=1024)
