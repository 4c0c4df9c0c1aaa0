"""The engine's K/V: its budget (``budget.size_kv``, before any weight is read) and the block
pool with per-request block tables that holds it (``cache.KVCache``)."""
from tailrl.engine.kv.budget import size_kv
from tailrl.engine.kv.cache import KVCache

__all__ = ["KVCache", "size_kv"]
