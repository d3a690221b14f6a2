"""The core (cache, engine, model, config, the LLM API) imports no tool (plan, quant, bench,
server, cli, cluster, tune): tools build on the core, never the other way round; no two modules
import each other, however indirectly; the model runner reads the step plan, never the KV
manager or the scheduler."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent / "kvserve"
CORE = [*ROOT.glob("cache/*.py"), *ROOT.glob("engine/*.py"), *ROOT.glob("model/*.py"), ROOT / "config.py",
        ROOT / "llm.py"]
TOOLS = ("kvserve.plan", "kvserve.quant", "kvserve.bench", "kvserve.server", "kvserve.cli", "kvserve.cluster",
         "kvserve.tune")


def imported_modules(path: Path, top_level: bool = False) -> set[str]:
    """The modules ``path`` imports (``top_level``: at import time, not inside functions)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_imports_no_tool() -> None:
    assert len(CORE) > 15
    wrong = {f"{path.relative_to(ROOT)} imports {name}" for path in CORE for name in imported_modules(path)
             if name.startswith(TOOLS)}
    assert not wrong, sorted(wrong)


def test_ray_is_imported_only_by_the_ray_deployment() -> None:
    """Without --ray nothing imports ray: only cluster/deploy.py and cluster/routers.py may."""
    importers = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
                 if any(name == "ray" or name.startswith("ray.") for name in imported_modules(path))}
    assert importers == {"cluster/deploy.py", "cluster/routers.py"}
    code = ("import sys, kvserve.cli, kvserve.server.serve, kvserve.cluster.config; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    loaded = subprocess.run([sys.executable, "-c", code],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles() -> None:
    """The module-level import graph of kvserve is acyclic (a cycle: the first found, in order)."""
    graph = {module_name(path): {name for name in imported_modules(path, top_level=True)
                                 if name.startswith("kvserve.")} for path in ROOT.rglob("*.py")}
    assert len(graph) > 60
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for name in sorted(graph.get(module, ())):
            if state.get(name) == 1:
                return [*path[path.index(name):], name] if name in path else [module, name]
            if name in graph and not state.get(name):
                cycle = visit(name, [*path, name])
                if cycle:
                    return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if not state.get(module):
            cycle = visit(module, [module])
            assert cycle is None, " -> ".join(cycle)


def test_the_runner_reads_only_the_step_plan() -> None:
    names = imported_modules(ROOT / "engine" / "model_runner.py")
    assert "kvserve.engine.step_plan" in names
    assert not names & {"kvserve.cache.kv_cache_manager", "kvserve.engine.scheduler", "kvserve.cache.prefix_cache"}


def test_the_server_and_tools_read_the_engine_through_its_public_surface() -> None:
    """The server, the cluster, the load tester, the planner, the tuner and the quantization tools
    use LLMEngine's public methods and stats, never its KV manager, scheduler, runner, storage or
    feature hooks."""
    import re

    inner = re.compile(r"engine\.(kv_manager|scheduler|runner|kv_cache|streaming_hook|snapkv)\b")
    wrong = [f"{path.relative_to(ROOT)}:{n}" for package in ("server", "cluster", "bench", "plan", "tune", "quant")
             for path in (ROOT / package).rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if inner.search(line)]
    assert not wrong, wrong
