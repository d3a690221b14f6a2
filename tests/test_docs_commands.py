"""The commands and code the README and the guide show work as written: every ``kvserve``
command parses with the real command line (its engine settings validated as the CLI validates
them), the capacity plans run, and the README's Python example runs on the default model."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kvserve.cli import build_parser, engine_kwargs, main
from kvserve.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
# the benchmark reference's commands need peers' venvs and long runs; its scripts are tested apart
PAGES = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"]
FENCE = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", re.S)


def doc_commands() -> list[tuple[str, str]]:
    """(page, command) for each ``kvserve ...`` line in a shell block, continuations joined and
    comments dropped; commands with elisions (``...``, ``[optional flags]``) are illustrations."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            command = ""
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if not command and not line.startswith("kvserve "):
                    continue
                command = f"{command} {line}".strip()
                if command.endswith("\\"):
                    command = command[:-1]
                    continue
                if "..." not in command and "[" not in command:
                    found.append((page.name, command))
                command = ""
    return found


COMMANDS = doc_commands()


def test_the_pages_show_commands_to_check() -> None:
    pages = {page for page, _ in COMMANDS}
    assert {"cli.md", "plan.md", "quantization.md", "serving.md"} <= pages, pages
    assert len(COMMANDS) >= 20
    assert any(page == "plan.md" for page, _, _ in shown_outputs())  # an output shown is checked too


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_documented_command_parses(page: str, command: str) -> None:
    parser, _ = build_parser()
    argv = shlex.split(command)[1:]
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{page}: `{command}` does not parse")
    if args.command in ("generate", "serve"):
        EngineConfig.from_settings(model=args.model, **engine_kwargs(args))  # a bad value raises, naming it


PLANS = [(page, command) for page, command in COMMANDS
         if command.startswith("kvserve plan") and "path/to" not in command]


@pytest.mark.parametrize(("page", "command"), PLANS, ids=[f"{p}:{c[:60]}" for p, c in PLANS])
def test_documented_capacity_plans_run(page: str, command: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(shlex.split(command)[1:]) == 0, command
    assert "KV" in out.getvalue()


def test_the_readme_python_example_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S)
    assert example, "README.md has a Python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example.group(1), "README.md", "exec"), {})  # the README's own code
    printed = out.getvalue()
    assert printed.lstrip().startswith("Paris"), printed  # greedy: "The capital of France is" Paris
    assert "KV cache: usage" in printed and "prefix cache: hit rate" in printed, printed


def shown_outputs() -> list[tuple[str, str, str]]:
    """(page, command, output) for each ``$ kvserve ...`` block whose output a page shows."""
    shown = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            if not block.startswith("$ kvserve "):
                continue
            lines = block.splitlines()
            command = lines[0][2:]
            rest = 1
            while command.endswith("\\"):
                command = command[:-1] + " " + lines[rest].strip()
                rest += 1
            shown.append((page.name, command, "\n".join(lines[rest:])))
    return shown


SHOWN = shown_outputs()


@pytest.mark.parametrize(("page", "command", "output"), SHOWN, ids=[f"{p}:{c[:50]}" for p, c, _ in SHOWN])
def test_shown_outputs_are_what_the_commands_print(page: str, command: str, output: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # the width the pages were rendered at
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(shlex.split(command)[1:]) == 0
    words = [line.split() for line in printed.getvalue().splitlines() if line.strip()]
    assert words == [line.split() for line in output.splitlines() if line.strip()], f"{page}: `{command}`"
