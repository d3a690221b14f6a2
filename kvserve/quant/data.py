"""Text for calibration and evaluation: the user's files, or two built-in offline corpora.

Built-in corpora (real English prose shipped with every CPython, so they work offline; they are
disjoint texts):

- ``builtin:stdlib-docstrings`` — docstrings (>= 200 characters) of the public classes and
  functions of a fixed list of standard-library modules: the default calibration set;
- ``builtin:python-reference`` — the Python Language Reference topics of ``pydoc_data.topics``
  (the text ``help("if")`` shows): the default held-out evaluation set.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError, read_jsonl_prompts

_DOCSTRING_MODULES = (
    "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email.message", "fractions",
    "functools", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "pathlib", "pickle",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "zipfile",
)
Sample = str | list[dict[str, Any]]  # a text, or chat messages


def stdlib_docstrings() -> list[str]:
    texts: list[str] = []
    seen: set[str] = set()
    with warnings.catch_warnings():  # some modules have deprecated attributes
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in _DOCSTRING_MODULES:
            _module_docstrings(name, texts, seen)
    return texts


def _module_docstrings(name: str, texts: list[str], seen: set[str]) -> None:
    """Append the module's and its public objects' long docstrings not seen before."""
    module = importlib.import_module(name)
    objects = [module] + [getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_")]
    for obj in objects:
        doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else None
        if doc and len(doc) >= 200 and doc not in seen:
            seen.add(doc)
            texts.append(doc)


def python_reference() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


BUILTIN: dict[str, Callable[[], list[str]]] = {
    "builtin:stdlib-docstrings": stdlib_docstrings,
    "builtin:python-reference": python_reference,
}


def read_samples(source: str) -> list[Sample]:
    """A built-in corpus name; a .jsonl file of objects with "text", "prompt" or "messages"; or a
    plain text file (one sample per blank-line-separated paragraph group)."""
    if source in BUILTIN:
        return list(BUILTIN[source]())
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"--data {source!r} is neither a file nor one of {', '.join(BUILTIN)}")
    if path.suffix == ".jsonl":
        return read_jsonl_prompts(path)
    return [part.strip() for part in path.read_text().split("\n\n") if part.strip()]


Encode = Callable[[str], list[int]]
Chat = Callable[[list[dict[str, Any]]], list[int]]


def tokenize(samples: list[Sample], encode: Encode, chat: Chat) -> list[list[int]]:
    """Token ids of each sample: texts encoded, messages through the model's chat template."""
    return [chat(s) if isinstance(s, list) else encode(s) for s in samples]


def token_stream(samples: list[Sample], encode: Encode, chat: Chat, limit: int) -> list[int]:
    """The samples' tokens one after another, the first ``limit`` of them (samples past the
    limit are not tokenized)."""
    stream: list[int] = []
    for sample in samples:
        stream += chat(sample) if isinstance(sample, list) else encode(sample)
        if len(stream) >= limit:
            break
    return stream[:limit]
