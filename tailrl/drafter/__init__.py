"""TLT's learned drafter, all of it: the network (``network``: one decoder layer over the
target's hidden state and the next token's embedding, sharing the target's embedding and LM
head), its runtime state (``past``: each request's drafter K/V; ``buffer``: the rollout's
hidden states kept for training), its training (``train``: the loss and offline steps;
``spot_trainer``: online, between engine steps while the tail idles; ``pool_spot``: one per
instance of a rollout pool) and its evaluation (``evaluate``). Depends on ``model`` only; used
by ``speculative`` (the drafter as a draft source) and ``rl`` (training it in a run)."""
