"""The first run a user makes with their own checkpoint, end to end: `tailrl train` over a
Qwen2.5-0.5B-config checkpoint (random weights, 2 layers, its 151,936-token vocabulary) and a
parquet of chat prompts (the chat template applied), a few steps with the defaults; then
`tailrl serve` over the trained checkpoint answers the openai client."""
import json

import pytest
from real_configs import make_real_checkpoint


@pytest.mark.slow   # ~1-2 min: builds a 166M-parameter checkpoint, two GRPO steps, a server
def test_train_on_a_real_config_checkpoint_then_serve_it(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("openai")
    import pyarrow.parquet as pq

    from tailrl.rl.cli import train_main
    model = make_real_checkpoint(str(tmp_path / "model"), "qwen2.5-0.5b")
    rows = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"{a} + {b} = ?"}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model}\ndataset: {data}\nbatch_size: 2\ngroup_size: 2\nmax_tokens: 16\n"
                   f"total_steps: 2\ncheckpoint_every: 0\nprogress: false\nlog_tensorboard: false\n"
                   f"output_dir: {tmp_path / 'run'}\n")
    assert train_main([str(cfg)]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["steps"] == 2 and figures["speculation"] is True
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["actor/rollout_logprob_diff"] == 0.0 for m in metrics)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "model.safetensors").is_file()

    from openai import OpenAI
    from serve_helpers import start_server
    with start_server(str(ckpt)) as s:
        client = OpenAI(base_url=s.base_url + "/v1", api_key="test-key")
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2 + 2 = ?"}],
                                             max_tokens=8, temperature=0)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens == 8
