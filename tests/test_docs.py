"""The project speaks of itself: no work-log entry numbers, issue numbers or development-machine
paths in its code, messages, docs or file names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvserve", "tests", "benchmarks", "docs", "deploy", "examples", ".ci")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml")
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".cpp", ".h", ".json", ".txt", ""}
WORK_LOG_NAME = re.compile(r"sessions?\s*\d+|issues?\s*\d+", re.IGNORECASE)  # names run words together
WORK_LOG = re.compile(r"\bsessions?\s+\d+|\bissues?\s+#?\d+|(?<![\w.])/(?:work|root|home/\w+)/", re.IGNORECASE)


def _files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES]
    for folder in SCANNED:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in files if p.suffix in SUFFIXES]


def test_no_work_log_references_in_code_docs_or_file_names() -> None:
    found = []
    for path in _files():
        name = path.relative_to(ROOT).as_posix()
        if WORK_LOG_NAME.search(name.replace("_", " ")):
            found.append(f"{name}: its name")
        text = path.read_text(errors="replace")
        for match in WORK_LOG.finditer(text):  # across line breaks too ("session\n36")
            number = text.count("\n", 0, match.start()) + 1
            found.append(f"{name}:{number}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_is_for() -> None:
    number = "27"  # joined at run time, so that this file passes its own scan
    for text in (f"as session {number} found", f"see issue #{number}", f"Issue {number}", "cd /" + "work/main",
                 "/" + "home/dev/x", f"Session\n{number}"):
        assert WORK_LOG.search(text), text
    for text in ("sessions of a chat", "an issue with", "kvserve/model/csrc", "docs/results/x.json"):
        assert not WORK_LOG.search(text), text
