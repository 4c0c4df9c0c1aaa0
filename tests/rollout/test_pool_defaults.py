"""What a user gets without knobs: a default pool divides its requests (chunks chosen from
max_tokens) with one engine's outputs, a script without an ``if __name__ == "__main__":``
guard runs a pool of worker processes, and the example of docs/pool.md runs as written."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pool_utils import PROMPTS, assert_same, lengths, pool_ckpt

from tailrl import LLM, SamplingParams
from tailrl.config import PoolConfig
from tailrl.rl.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def run_script(path: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run a user's script the way a user would: its own interpreter, its own main module."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(path), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stderr[-4000:]}"
    return done


def test_chunk_size_rule():
    cfg = PoolConfig(instances=2)
    assert cfg.chunk_tokens is None
    assert [cfg.chunk_for(n) for n in (1, 40, 256, 300, 960, 8192, 40_960)] == [64, 64, 64, 75, 240, 2048, 2048]
    assert PoolConfig().chunk_for(960) == 960                          # one instance: whole requests
    assert PoolConfig(instances=2, chunk_tokens=8192).chunk_for(960) == 8192    # an explicit size is kept
    assert PoolConfig(chunk_tokens=7).chunk_for(960) == 7
    for bad in (0, -1, True, 2.5, "64"):
        with pytest.raises(ValueError, match="chunk_tokens"):
            PoolConfig(chunk_tokens=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        cfg.chunk_for(0)


def test_trainer_takes_the_same_default(tmp_path):
    kw = dict(model="test", instances=2, scheduler="context", output_dir=str(tmp_path))
    assert TrainConfig(**kw).chunk_tokens is None
    assert TrainConfig(**kw).pool_config().chunk_tokens is None
    assert TrainConfig(**kw, chunk_tokens=16).pool_config().chunk_tokens == 16
    with pytest.raises(ValueError, match="chunk_tokens"):
        TrainConfig(**kw, chunk_tokens=0)


def test_default_context_pool_divides_requests(ckpt_dir):
    path = pool_ckpt(ckpt_dir)
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=256, seed=2000 + i) for i in range(len(PROMPTS))]
    ref = LLM(path, dtype="float64").generate(PROMPTS, params)
    sizes = [n for g in lengths(ref) for n in g]
    assert any(n > 64 for n in sizes) and any(n <= 64 for n in sizes)    # some need several chunks

    llm = LLM(path, dtype="float64", instances=2, scheduler="context")   # worker processes, no pool knobs
    try:
        assert all(h.pid != os.getpid() for h in llm.pool.instances)
        assert_same(llm.generate(PROMPTS, params), ref)
        m = llm.last_metrics
    finally:
        llm.close()
    assert m["pool/chunk_tokens"] == 64                                   # 256 // 4
    # every response ran in as many chunks as 64-token pieces it has (no speculation, no faults)
    assert m["pool/chunks"] == sum(math.ceil(n / 64) for n in sizes) > len(sizes)
    assert m["pool/local_resumes"] + m["pool/migrations"] == m["pool/chunks"] - len(sizes)

    # an explicit chunk as large as before divides nothing, as before
    llm = LLM(path, dtype="float64", instances=2, scheduler="context", pool={"chunk_tokens": 8192, "processes": False})
    assert_same(llm.generate(PROMPTS, params), ref)
    assert llm.last_metrics["pool/chunk_tokens"] == 8192 and llm.last_metrics["pool/chunks"] == len(sizes)


SCRIPT = """\
import json
import sys

from tailrl import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float64", instances=2, scheduler="context")
outs = llm.generate([[1, 2, 3], [9, 8, 7, 6, 5]], SamplingParams(n=2, max_tokens=100, seed=7))
print(json.dumps([[c.token_ids for c in o.outputs] for o in outs]))
llm.close()
"""


def test_script_without_main_guard_runs_a_process_pool(ckpt_dir, tmp_path):
    path = pool_ckpt(ckpt_dir)
    ref = LLM(path, dtype="float64").generate([[1, 2, 3], [9, 8, 7, 6, 5]], SamplingParams(n=2, max_tokens=100, seed=7))
    script = tmp_path / "rollout.py"
    script.write_text(SCRIPT)
    done = run_script(script, path, cwd=tmp_path)
    assert json.loads(done.stdout.splitlines()[-1]) == [[c.token_ids for c in o.outputs] for o in ref]


def test_pool_example_in_the_docs_runs_as_written(tmp_path):
    text = (REPO / "docs" / "pool.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "instances=2" in example and "if __name__" not in example
    script = tmp_path / "example.py"
    script.write_text(example)
    done = run_script(script, cwd=REPO)             # models/small is relative to the repository
    chunk, chunks, migrations, tail = map(float, done.stdout.split()[-4:])
    assert chunk == 128 and chunks >= 24 and migrations >= 0 and tail >= 0     # 3 prompts x 8
