import os
import sys

import pytest
import torch

if not torch.cuda.is_available():                      # the Triton kernels run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # every lane is a program the interpreter runs in Python: two lanes keep the engine tests'
    # time (test_attention_lanes_... checks the default's 16)
    os.environ.setdefault("TAILRL_ATTENTION_LANES", "2")


def _dots_alike_for_every_row() -> None:
    """Triton's interpreter computes ``tl.dot`` with numpy's matmul, whose BLAS may round a
    row by its place in the tile (OpenBLAS on an AMD EPYC: rows 6-15 of a 64 x 128 x 64 float32
    tile otherwise than row 0), where a GPU's dot instructions treat a tile's rows alike: the
    row-invariance tests would test numpy. Under the interpreter a dot here is its products
    summed along K in numpy's fixed order, the same for every row."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dt = d.data.dtype
        products = a.data.astype(dt)[..., :, :, None] * b.data.astype(dt)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=dt) + d.data, d.dtype.scalar)
    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _dots_alike_for_every_row()

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


@pytest.fixture(scope="session")
def triton_model(ckpt_dir):
    """``model`` for the engine tests through the Triton kernels: under the interpreter (no GPU)
    one layer of two query heads sharing one K/V head, since every program of every launch runs
    in Python there and attention's and RoPE's programs are per head (``model``'s two layers of
    4 and 2 heads take those tests 2-3x as long and add nothing the kernel tests and the
    two-layer architectures' end-to-end tests do not cover); on a GPU ``model`` itself."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ckpt_dir("qwen2", init_std=3.0, max_pos=1024, num_layers=1, num_heads=2, num_kv_heads=1)
    return ckpt_dir("qwen2", init_std=3.0, max_pos=1024)
