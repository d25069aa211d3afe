"""The package's shape: no import circles between its modules, and process-wide patches that last only
while a model is offloaded."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import torch
from torch import nn

import weightstream as ws
from weightstream.engine import engine, ops, replay

PACKAGE = Path(ws.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, at any depth of its code (a function's import and
    one under `if TYPE_CHECKING:` included: a circle of annotations is a circle of ideas too).
    `from . import x` imports the module x, not the package."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return (found & modules.keys()) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the list of its modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle_and_none_where_there_is_none():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_the_package_imports_itself_back_in_a_circle():
    modules = _modules()
    assert {"weightstream.engine.engine", "weightstream.placement.plan", "weightstream.wire.codec",
            "weightstream.formats.hf", "weightstream.offload"} <= modules.keys()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # the walk sees real edges: the front door reaches the engine through the handle
    assert "weightstream.handle" in graph["weightstream.offload"]
    assert "weightstream.engine.engine" in graph["weightstream.handle"]
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_process_wide_hooks_are_installed_while_a_model_is_offloaded_and_gone_after_the_last_restore():
    """The CUDA graph hook and the module-registration hook: installed by the first engine, taken off by the
    last one restored or dropped, torch as it was."""
    gc.collect()  # models of earlier tests dropped without restore: their engines go, and the hook with them
    graph = torch.cuda.CUDAGraph
    assert not ops.engines() and not engine.process_hooks_installed()
    registration = dict(nn.modules.module._global_module_registration_hooks)
    before = {name: getattr(graph, name) for name in ("capture_begin", "capture_end", "replay")}
    models = [nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]) for _ in range(2)]
    handles = [ws.offload(m, gpu_memory=8 * 8 * 4 * 3, device="cpu", blocks=[""], strategy="stream")
               for m in models]
    assert replay.installed() and engine.process_hooks_installed()
    assert all(getattr(graph, name) is not method for name, method in before.items())
    assert len(nn.modules.module._global_module_registration_hooks) == len(registration) + 1
    handles[0].restore()
    assert replay.installed()  # the other model is still offloaded
    handles[1].restore()
    assert not engine.process_hooks_installed()
    assert {name: getattr(graph, name) for name in before} == before
    assert dict(nn.modules.module._global_module_registration_hooks) == registration
    # a model dropped without restore takes the hook with it
    dropped = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ws.offload(dropped, gpu_memory=8 * 8 * 4 * 3, device="cpu", blocks=[""], strategy="stream")
    assert replay.installed()
    del dropped
    gc.collect()
    assert not ops.engines() and not engine.process_hooks_installed()


def test_a_model_dropped_while_torch_compile_traces_leaves_the_registration_hook_until_the_next_restore():
    """The garbage collector may finalize an engine in the middle of a trace, after dynamo guarded on the
    module-registration hooks it saw; removing ours then failed that compile (KeyError while building
    guards). So under a tracing context the hook stays, and the next last restore takes it off."""
    from torch._guards import TracingContext, tracing

    gc.collect()
    registration = dict(nn.modules.module._global_module_registration_hooks)
    dropped = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ws.offload(dropped, gpu_memory=8 * 8 * 4 * 3, device="cpu", blocks=[""], strategy="stream")
    with tracing(TracingContext(fake_mode=None)):
        del dropped
        gc.collect()
        assert not ops.engines()
        assert len(nn.modules.module._global_module_registration_hooks) == len(registration) + 1
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ws.offload(model, gpu_memory=8 * 8 * 4 * 3, device="cpu", blocks=[""], strategy="stream").restore()
    assert not engine.process_hooks_installed()
    assert dict(nn.modules.module._global_module_registration_hooks) == registration


def test_the_license_file_is_the_one_pyproject_names():
    root = Path(__file__).parents[1]
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    assert 'license = { text = "Apache-2.0" }' in (root / "pyproject.toml").read_text()
