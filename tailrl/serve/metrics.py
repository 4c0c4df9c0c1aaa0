"""``GET /metrics``: the engine's verl-style keys and the server's counters, as Prometheus text.

A custom collector reads the engine loop's latest snapshot at scrape time (the loop thread
replaces it whole, so the scrape never touches the engine). Names map ``/`` to ``_`` under a
``tailrl_`` prefix: ``rollout/num_forward`` is ``tailrl_rollout_num_forward_total``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tailrl.serve import require
from tailrl.serve.loop import COUNTER_KEYS, EngineLoop


@dataclass
class ServeCounters:
    """Per-server counters, touched only on the event-loop thread."""

    requests: int = 0                    # HTTP generation requests accepted
    request_errors: int = 0              # answered with an error status
    prompt_tokens: int = 0
    generation_tokens: int = 0


def prom_name(key: str) -> str:
    return "tailrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _Collector:
    def __init__(self, loop: EngineLoop, counters: ServeCounters) -> None:
        self.loop, self.counters = loop, counters

    def collect(self):
        core = require("prometheus_client.core")
        counter_keys = set(COUNTER_KEYS.values())
        for key, value in sorted(self.loop.stats().items()):
            cls = core.CounterMetricFamily if key in counter_keys else core.GaugeMetricFamily
            yield cls(prom_name(key), f"engine {key}", value=value)
        for name, value in vars(self.counters).items():
            yield core.CounterMetricFamily(prom_name(f"serve/{name}"), f"server {name}", value=float(value))
        yield core.GaugeMetricFamily(prom_name("serve/live_sequences_now"), "sequences queued or running",
                                     value=float(self.loop.live_sequences))


class Metrics:
    """One registry per server (not the global one: several servers may live in one process)."""

    def __init__(self, loop: EngineLoop, counters: ServeCounters) -> None:
        prom = require("prometheus_client")
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        self.registry.register(_Collector(loop, counters))

    def render(self) -> tuple[bytes, str]:
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
