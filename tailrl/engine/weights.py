"""An engine's model and K/V pool: sized before any weight is read (kv/budget.py), then the model
whole in this process, or split over ``tensor_parallel_size`` ranks (tensor_parallel.py) with a
K/V pool whose copies those ranks repeat."""
from __future__ import annotations

import torch

from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.engine.kv import KVCache, size_kv
from tailrl.engine.kv.states import refuse
from tailrl.engine.tensor_parallel import ParallelModel, parallel_args
from tailrl.model.loader import DTYPES, load_model, read_args


def load(config: EngineConfig, speculative: SpeculativeConfig | None) -> tuple[object, KVCache, int]:
    """(model, K/V pool, max_model_len) of an engine."""
    dtype = DTYPES[config.dtype]
    split = config.tensor_parallel_size > 1
    args = read_args(config.model)
    refuse(args, config, speculative)       # what a model with recurrent layers can not run with
    windows = [w for w in args.layer_windows if w]
    if speculative is not None and windows and speculative.max_draft_tokens >= min(windows):
        # a tree node sees every ancestor: that is its window only while drafts are shorter than it
        raise ValueError(f"speculative_config.max_draft_tokens: {speculative.max_draft_tokens} must be below the "
                         f"model's smallest sliding window, {min(windows)} positions")
    if split:                               # each device's part: its heads' K/V, its share of the weights
        args = parallel_args(config, args, speculative)
    # the KV budget and the context that fits it, before any weight is read
    budget, max_len = size_kv(args, config, torch.tensor([], dtype=dtype).element_size())
    if split:
        model = ParallelModel(config, max_len, budget)
    else:
        model = load_model(config.model, config.dtype, config.device, max_len)
        model.prepare_kernels()             # on a GPU: where cuBLAS may compute (kernels/gpu/stock.py)
    if torch.device(config.device).type == "cuda":
        torch.cuda.empty_cache()            # what deciding that took, back before the K/V pool
    pool = model.kv_cache if split else KVCache
    kv = pool(model.args, dtype, config.device, budget, config.max_num_seqs, max_len,
              prefix_caching=config.enable_prefix_caching)
    return model, kv, max_len
