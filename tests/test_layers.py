"""Data flows one way (docs/DESIGN's layers): ``rl`` -> ``rollout`` -> ``engine`` -> ``model`` ->
``kernels``; ``speculative`` used by ``engine``, ``drafter`` by ``speculative`` and ``rl``,
``tasks`` as data, ``cli`` at the top. Every import of a ``tailrl`` module, lazy ones inside
functions included, is checked against the table below."""
import ast
import pathlib

import tailrl

ROOT = pathlib.Path(tailrl.__file__).parent
API = {"tailrl", "llm", "config"}          # the public API: the package root re-exports llm and config
LEAVES = {"extras", "threads", "noise", "programs"}   # every layer may use them; they import no other layer

# layer -> the layers it may import. A layer is a subpackage of tailrl or a top-level module.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "extras": set(),                                              # optional imports
    "threads": set(),                                             # process-wide torch thread count
    "noise": set(),                                               # counter-based sampling noise, seed keys
    "programs": set(),                                            # tailrl's own processes (python -m ...)
    "kernels": {"config"},                                        # one implementation per device of each hot op
    "model": {"config", "kernels"},
    "drafter": {"config", "kernels", "model"},                    # TLT's drafter: network, state, training
    "speculative": {"config", "model", "drafter"},                # draft sources, policies, the Speculator
    "engine": {"config", "kernels", "model", "speculative"},
    "llm": {"config", "model", "speculative", "engine", "rollout"},   # the facade over one engine (or a pool)
    "tailrl": {"config", "llm"},                                  # tailrl/__init__.py
    "rollout": {"config", "model", "speculative", "engine"},
    "tasks": {"config"},                                          # data: no engine, no model code
    "sim": {"config", "rollout", "tasks"},                        # the schedulers, never the engine
    "rl": {"config", "model", "drafter", "speculative", "engine", "rollout", "tasks", "llm", "tailrl"},
    "serve": {"config", "model", "speculative", "engine", "rollout", "llm", "tailrl"},
    # public API; a framework's rollout server is a server (verl's wraps serve/samples.py);
    # task data in a framework's layout (verl's parquet and reward)
    "integrations": API | {"rollout", "serve", "tasks"},
    # applications at the top: commands over several packages (tailrl/cli/), dispatch included
    "cli": {"config", "kernels", "model", "drafter", "speculative", "engine", "rollout", "tasks", "sim", "rl",
            "serve", "llm", "tailrl"},
}
for _deps in ALLOWED.values():
    _deps.update(LEAVES)

# Upward imports that remain, each with its reason. Remove an entry when its import goes.
EXCEPTIONS: set[tuple[str, str]] = set()


def layer_of(module: str) -> str:
    """'tailrl.engine.sampler' -> 'engine'; 'tailrl' -> 'tailrl'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tailrl"


def imported_layers(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
            if node.module == "tailrl":          # `from tailrl import x`: a submodule or the root's API
                mods = [f"tailrl.{a.name}" if (ROOT / f"{a.name}.py").exists() or (ROOT / a.name).is_dir()
                        else "tailrl" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: relative import; use absolute tailrl.* imports")
        else:
            continue
        out |= {layer_of(m) for m in mods if m == "tailrl" or m.startswith("tailrl.")}
    return out


def modules() -> list[tuple[str, str, pathlib.Path]]:
    """(path relative to the repo, layer, path) of every module in the package."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        out.append((str(pathlib.Path("tailrl") / rel), "tailrl" if name == "__init__" else name, path))
    return out


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted({(rel, layer) for rel, layer, _ in modules() if layer not in ALLOWED})
    assert not unknown, f"add these layers to ALLOWED (see DESIGN.md): {unknown}"


def test_no_upward_imports():
    bad = []
    for rel, layer, path in modules():
        for dst in sorted(imported_layers(path) - {layer}):
            if dst not in ALLOWED.get(layer, set()) and (rel, dst) not in EXCEPTIONS:
                bad.append(f"{rel} ({layer}) imports {dst}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_exceptions_are_still_needed():
    found = {(rel, dst) for rel, _, path in modules() for dst in imported_layers(path)}
    present = {(rel, dst) for rel, dst in EXCEPTIONS if (ROOT.parent / rel).exists()}
    assert present <= found, f"remove from EXCEPTIONS: {sorted(present - found)}"
