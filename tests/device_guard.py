"""A CPU stand-in for "every tensor on the engine's device": PyTorch's default device set to
``meta``, and any operation that mixes a ``meta`` tensor with a real one refused.

A tensor built without naming its device (``torch.tensor(rows)`` where ``torch.tensor(rows,
device=dev)`` was meant) becomes a ``meta`` tensor and fails at its first use, as a host
tensor meets a CUDA one on a GPU; reading it (``.tolist()``, ``int()``) fails too. Host data
meant to stay on the host names ``device="cpu"``. The guard is needed beyond the default
device: indexing a CPU tensor with a ``meta`` index silently reads garbage.
"""
import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class _NoMixing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if "meta" in devices and len(devices) > 1:
            raise RuntimeError(f"{getattr(func, '__name__', func)}: a tensor made without a device meets "
                               f"one on {sorted(devices - {'meta'})}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_default_device():
    with torch.device("meta"), _NoMixing():
        yield


def guarded(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with no_default_device():
            return fn(*args, **kwargs)
    return run


def guard(monkeypatch, owner, *names):
    """Run ``owner``'s ``names`` (methods or module functions) under ``no_default_device``."""
    for name in names:
        monkeypatch.setattr(owner, name, guarded(getattr(owner, name)))
