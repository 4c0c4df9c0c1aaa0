"""``PromptRouter``: verl's request router for tailrl replicas, sticky by prompt.

verl's default router sends each request to the least loaded replica, sticky by request id; but
its agent loop gives every sample its own request id, so with several replicas a prompt's
siblings land on different replicas (their group drafts are lost) and next epoch's samples land
anywhere (its history lives on one replica's engine: history drafts are lost too). This router
assigns each prompt (a digest of its tokens) to one replica, the least loaded when the prompt is
first seen, and sends all its samples, in every epoch, there.

Use it with ``actor_rollout_ref.rollout.router_config_path=<CONFIG>`` (``CONFIG``: the YAML
beside this file, naming this class; ``max_prompts`` bounds the assignments kept, least recently
used first out). A replica that leaves the pool loses its prompts; they are reassigned.
"""
from __future__ import annotations

import os
from collections import OrderedDict

from tailrl.serve.samples import prompt_key

CONFIG = os.path.join(os.path.dirname(__file__), "router.yaml")


class PromptRouter:
    """verl's ``RequestLoadBalancer`` protocol; made a Ray actor by verl."""

    def __init__(self, servers: dict, config: dict | None = None) -> None:
        self._servers = dict(servers)
        self._inflight = {sid: 0 for sid in servers}
        self._max = int((config or {}).get("max_prompts", 100_000))
        self._home: OrderedDict[str, str] = OrderedDict()      # prompt key -> server id

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return []

    def acquire_server(self, request_id: str, prompt_ids=None, **unused) -> tuple:
        if not self._servers:
            raise RuntimeError("no rollout server in the pool")
        key = prompt_key(list(prompt_ids or [])) if prompt_ids else request_id
        sid = self._home.get(key)
        if sid not in self._servers:
            sid = min(self._servers, key=lambda s: (self._inflight[s], s))
        self._home[key] = sid
        self._home.move_to_end(key)
        while len(self._home) > self._max:
            self._home.popitem(last=False)
        self._inflight[sid] += 1
        return sid, self._servers[sid]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if server_id in self._inflight:
            self._inflight[server_id] = max(0, self._inflight[server_id] - 1)

    def add_servers(self, servers: dict) -> None:
        for sid, handle in servers.items():
            self._servers[sid] = handle
            self._inflight.setdefault(sid, 0)

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:
            self._servers.pop(sid, None)
            self._inflight.pop(sid, None)

    def get_all_servers(self) -> list[str]:
        return list(self._servers)

    def get_inflight_count(self, server_id: str) -> int:
        return self._inflight.get(server_id, 0)

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    def get_status(self) -> dict:
        return {"servers": dict(self._inflight), "total_inflight": self.get_total_inflight(),
                "active_servers": len(self._servers), "prompts": len(self._home)}

    def clear_sticky_cache(self) -> dict:
        """verl calls this on phase switches; a prompt's replica is where its history is, so
        the assignments stay (a cleared one would lose the prompt's history drafts)."""
        return {"cleared_entries": 0, "server_loads": dict(self._inflight)}
