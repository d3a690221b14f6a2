"""The core (cache, engine, model, config, the LLM API) imports no tool (plan, quant, bench,
server): tools build on the core, never the other way round."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent / "kvserve"
CORE = [*ROOT.glob("cache/*.py"), *ROOT.glob("engine/*.py"), *ROOT.glob("model/*.py"), ROOT / "config.py",
        ROOT / "llm.py"]
TOOLS = ("kvserve.plan", "kvserve.quant", "kvserve.bench", "kvserve.server", "kvserve.cli", "kvserve.cluster")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
