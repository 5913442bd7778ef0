"""The package's layers read one way: math <- runtimes <- entry points, and no import circles.

Read from the source with ``ast`` (nothing is imported): every ``import``/``from ... import``
inside ``hdet_megatron`` counts, also those inside functions (a lazy import still ties two
modules together; it only hides the circle from the interpreter).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hdet_megatron"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Layer of each module (by dotted name; a prefix ending in "." covers a subpackage). A module
#: may import modules of its own layer or a lower one, never a higher one.
MATH, RUNTIME, ENTRY = 0, 1, 2
LAYERS = {
    # math: plain numbers and data, no process groups of their own
    "hdet_megatron.config": MATH,
    "hdet_megatron.spread": MATH,
    "hdet_megatron.schedule": MATH,
    "hdet_megatron.controller": MATH,
    "hdet_megatron.line_signal": MATH,
    "hdet_megatron.line_search": MATH,
    "hdet_megatron.window_losses": MATH,
    "hdet_megatron.probe": MATH,
    "hdet_megatron.window": MATH,
    "hdet_megatron.averaging": MATH,
    "hdet_megatron.sim": MATH,
    "hdet_megatron.metrics": MATH,
    "hdet_megatron.corpus": MATH,
    "hdet_megatron.run_files": MATH,
    # runtimes: torch, FSDP2, Megatron-Core
    "hdet_megatron.torch_runtime": RUNTIME,
    "hdet_megatron.fsdp": RUNTIME,
    "hdet_megatron.torch_scheduler": RUNTIME,
    "hdet_megatron.megatron": RUNTIME,
    "hdet_megatron.megatron.": RUNTIME,
    "hdet_megatron.liveness": RUNTIME,
    # entry points: the package's face, CLI and flags, the megatron.training patch hooks, tools
    "hdet_megatron": ENTRY,
    "hdet_megatron.args": ENTRY,
    "hdet_megatron.preflight": ENTRY,
    "hdet_megatron.cli": ENTRY,
    "hdet_megatron.report": ENTRY,
    "hdet_megatron.run_dirs": ENTRY,
    "hdet_megatron.megatron.training_hooks": ENTRY,
    "hdet_megatron.megatron.preload": ENTRY,
    "hdet_megatron.megatron.sync_counter": ENTRY,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(name: str) -> int:
    if name in LAYERS:
        return LAYERS[name]
    prefixes = [p for p in LAYERS if p.endswith(".") and name.startswith(p)]
    assert prefixes, f"{name}: add it to LAYERS in tests/test_layers.py (math, runtime or entry?)"
    return LAYERS[max(prefixes, key=len)]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (the exact module; ``from pkg import sub`` is sub)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(edges: dict[str, set[str]]):
    """One import circle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circles():
    cycle = _cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_layers_read_one_way():
    wrong = [
        f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
        for a, targets in sorted(graph().items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert not wrong, "a lower layer imports a higher one (0 math, 1 runtime, 2 entry):\n" + "\n".join(wrong)


def test_the_check_finds_circles(tmp_path):
    """The checker itself: a circle hidden in a function body is found, relative imports too."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    lazy = tmp_path / "lazy.py"
    lazy.write_text(
        "def f():\n    from hdet_megatron.megatron import scheduler\n    from .ckpt import state\n"
    )
    modules = {
        "hdet_megatron.megatron.scheduler": lazy,
        "hdet_megatron.megatron.ckpt.state": lazy,
        "hdet_megatron.megatron.lazy": lazy,
    }
    assert _imports("hdet_megatron.megatron.lazy", lazy, modules) == {
        "hdet_megatron.megatron.scheduler",
        "hdet_megatron.megatron.ckpt.state",
    }
