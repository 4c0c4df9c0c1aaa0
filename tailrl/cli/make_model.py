"""`tailrl make-model --preset NAME | --standin NAME --out DIR`: train a workload model, or widen one.

``--preset`` builds the tokenizer and a Qwen2 model from scratch on the mixed task solutions
and saves a Hugging Face checkpoint (tailrl/tasks/make_model.py).

A stand-in (tailrl/model/standin.py) is computed from a trained checkpoint (``--source``,
default the shipped ``models/small``): the same tokens at a larger model's cost per step.
``--drafter DIR`` widens a learned drafter of the source with it (``OUT/drafter``,
tailrl/drafter/standin.py).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tailrl.drafter.standin import build_standin_drafter
from tailrl.model.standin import STANDINS, build_standin, get_standin
from tailrl.tasks.make_model import build
from tailrl.tasks.models import shipped_model
from tailrl.tasks.presets import PRESETS, get_preset


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tailrl make-model", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", choices=sorted(PRESETS), default=None, help="train this preset (default small)")
    what.add_argument("--standin", metavar="NAME", default=None,
                      help=f"build this stand-in of --source instead of training ({', '.join(STANDINS)})")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--source", default=None, help="stand-in only: the checkpoint to widen (default models/small)")
    p.add_argument("--drafter", default=None,
                   help="stand-in only: also widen this drafter of the source into OUT/drafter")
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument("--checkpoint-every", type=int, default=None, help="also save every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (changes the last bits)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.standin is not None:
        return _standin_main(p, args)
    if args.source is not None or args.drafter is not None:
        p.error("--source and --drafter go with --standin")
    preset = get_preset(args.preset or "small").with_overrides(
        steps=args.steps, checkpoint_every=args.checkpoint_every, num_threads=args.threads)
    figures = build(preset, args.out)
    print(f"saved {args.out}")
    print(json.dumps({"preset": preset.name, "out": str(args.out), **figures}))
    return 0


def _standin_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    training = [f"--{k.replace('_', '-')}" for k in ("steps", "checkpoint_every", "threads")
                if getattr(args, k) is not None]
    if training:
        p.error(f"{', '.join(training)} train a preset; a stand-in is not trained")
    source = args.source or shipped_model("small")
    if source is None:     # never fall back to an 80-minute build of small behind the user's back
        p.error("no models/small in this checkout: pass --source DIR (or build it with --preset small)")
    try:
        spec = get_standin(args.standin)
        figures = build_standin(spec, source, args.out)
        if args.drafter is not None:
            build_standin_drafter(spec, source, args.drafter, Path(args.out) / "drafter")
    except ValueError as e:
        p.error(str(e))
    print(f"saved {args.out}")
    drafter = {"drafter": str(Path(args.out) / "drafter")} if args.drafter is not None else {}
    print(json.dumps({"standin": spec.name, "source": str(source), "out": str(args.out), **figures, **drafter}))
    return 0
