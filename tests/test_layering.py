"""The core (cache, engine, model, config, the LLM API) imports no tool (plan, quant, bench,
server): tools build on the core, never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent / "kvserve"
CORE = [*ROOT.glob("cache/*.py"), *ROOT.glob("engine/*.py"), *ROOT.glob("model/*.py"), ROOT / "config.py",
        ROOT / "llm.py"]
TOOLS = ("kvserve.plan", "kvserve.quant", "kvserve.bench", "kvserve.server", "kvserve.cli")


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
