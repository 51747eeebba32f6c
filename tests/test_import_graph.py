"""The package's import graph has no cycle, and every module imports on its own.

1. Static: every ``import`` of a ``sao_megatron`` module in every file (module level *and* inside
   functions, so a function-level import that dodges a cycle still counts; ``if TYPE_CHECKING``
   blocks excepted) is an edge; importing ``a.b.c`` from outside package ``a.b`` also runs
   ``a/__init__`` and ``a/b/__init__``, so those are edges too. The strongly connected
   components of that graph must all be single modules.
2. Dynamic: each module is imported first, alone, in a fresh child process (forked from a parent
   that has imported only third-party packages), so an order-dependent import cycle fails there.
"""

from __future__ import annotations

import ast
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sao_megatron"
# third-party packages the parent imports before forking (heavy, and not ours)
THIRD_PARTY = ("torch", "safetensors", "sentencepiece", "httpx", "megatron.core")


def module_names() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names of the project modules a file imports (``from x import y``: x.y if it is a
    module, else x)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            found.append(base)
            found.extend(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it makes Python execute}`` (see the module docstring)."""
    modules = module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for name in _imports(tree, module, path.name == "__init__.py"):
            if name not in modules:
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                inside = module == target or module.startswith(target + ".")
                if target != module and (target == name or not inside):
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["sao_megatron.models.builders"]  # the parse found edges
    assert cycles(graph) == []


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["sao_megatron.parallel.sharding"].add("sao_megatron.models.builders")
    found = cycles(graph)
    assert len(found) == 1
    assert {"sao_megatron.parallel.sharding", "sao_megatron.models.builders"} <= set(found[0])


def _import_alone(name: str, conn) -> None:
    import importlib

    try:
        importlib.import_module(name)
        conn.send(None)
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(traceback.format_exc())


def import_each_module_alone() -> dict[str, str]:
    """``{module: traceback}`` of the modules that fail when imported first in a child forked
    from this process (which must not have imported the project yet)."""
    import importlib

    assert not any(m == PACKAGE or m.startswith(PACKAGE + ".") for m in sys.modules)
    for dep in THIRD_PARTY:
        importlib.import_module(dep)
    ctx = mp.get_context("fork")
    failures = {}
    names = [n for n in module_names() if not n.endswith((".vllm_worker_ext", ".__main__"))]
    # (run inside other programs: the vLLM server, ``python -m``); two children at a time
    for i in range(0, len(names), 2):
        started = []
        for name in names[i : i + 2]:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_import_alone, args=(name, child))
            proc.start()
            started.append((name, proc, parent))
        for name, proc, parent in started:
            err = parent.recv() if parent.poll(120) else "timed out"
            proc.join(30)
            if err:
                failures[name] = err
    return failures


def test_every_module_imports_first_in_a_fresh_process():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, tests.test_import_graph as t; "
            "print(json.dumps(t.import_each_module_alone()))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{k}:\n{v}" for k, v in failures.items())


def _lint_imports(config: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``lint-imports`` with `config`, analysing the package found from `cwd`."""
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), str(config), "--no-cache", "--no-logo"],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_package_layers_hold():
    """pyproject.toml's import-linter contract: no module imports from a layer above its own
    (docs/ARCHITECTURE.md, "Layers"), with no ignored import."""
    text = (ROOT / "pyproject.toml").read_text()
    assert "ignore_imports" not in text  # issue 32 removed the last known upward edges
    p = _lint_imports(ROOT / "pyproject.toml")
    assert p.returncode == 0 and "Contracts: 1 kept, 0 broken." in p.stdout, p.stdout + p.stderr


def test_package_layers_catch_an_upward_import(tmp_path):
    """The same contract on a copy of the package with one planted upward import (envs ->
    rollout, the edge the `agent` environment had) is broken, naming that import."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / PACKAGE, copy / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    planted = copy / PACKAGE / "envs" / "planted.py"
    planted.write_text("from sao_megatron.rollout.gateway import make_agent_environment\n")
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text((ROOT / "pyproject.toml").read_text())
    p = _lint_imports(cfg, cwd=copy)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "package layers BROKEN" in p.stdout
    assert "sao_megatron.envs.planted -> sao_megatron.rollout.gateway" in p.stdout
