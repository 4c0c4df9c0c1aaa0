"""`tailrl ...` entry point. This file only dispatches (argparse stays at the edge, imports
stay lazy so `tailrl --help` is instant). A package's own command lives beside it (``rl``,
``sim``, ``serve``); the commands over several packages (generate, make-model,
workload-report, train-drafter) live in this package."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). The function takes argv (list[str]).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("tailrl.cli.generate", "main", "sample responses from a checkpoint"),
    "make-model": ("tailrl.cli.make_model", "main", "train the workload model, or build a stand-in of it"),
    "workload-report": ("tailrl.cli.workload_report", "main", "accuracy, length tail and group similarity of a model"),
    "simulate": ("tailrl.sim.cli", "main", "cluster-scale rollout simulator: compare scheduling policies"),
    "train": ("tailrl.rl.cli", "train_main", "GRPO training with accelerated rollouts"),
    "train-drafter": ("tailrl.cli.train_drafter", "main", "warm-start the learned drafter on the model's own responses"),
    "report": ("tailrl.rl.cli", "report_main", "plot the metrics of one or two training runs"),
    "serve": ("tailrl.serve.cli", "main", "OpenAI-compatible HTTP server (extra: serve)"),
}


def _usage() -> str:
    lines = ["usage: tailrl COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tailrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
