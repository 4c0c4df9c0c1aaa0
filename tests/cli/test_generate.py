"""`tailrl generate`: sample from a checkpoint on a device; a bad device is an argument error."""
import json

import pytest
import torch

from tailrl.cli.generate import main
from tailrl.tasks.models import get_model


def test_generate_prints_responses_and_metrics(capsys):
    assert main(["--model", get_model("small"), "--prompt", "12+7=", "--n", "2", "--max-tokens", "6",
                 "--device", "cpu", "--speculative", "suffix"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("--- prompt") for line in out) == 2
    assert json.loads(out[-1])["rollout/num_requests"] == 2


@pytest.mark.parametrize("device", ["gpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_a_bad_device_is_an_argument_error(device, capsys):
    with pytest.raises(SystemExit):
        main(["--model", get_model("small"), "--prompt", "1", "--device", device])
    assert "device" in capsys.readouterr().err


@pytest.mark.parametrize("size, match", [("0", "tensor_parallel_size must be"), ("3", "does not divide")])
def test_a_split_that_cannot_be_made_is_an_argument_error(size, match, capsys):
    with pytest.raises(SystemExit):
        main(["--model", get_model("small"), "--prompt", "1", "--tensor-parallel-size", size])
    assert match in capsys.readouterr().err
