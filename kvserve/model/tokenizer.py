"""The model's tokenizer, read by the Rust ``tokenizers`` library and its chat template rendered by
jinja2, without importing transformers on the serving path.

Transformers converts a model's tokenizer once (from a GGUF's vocabulary or an HF folder's files)
and is the oracle; what it wrote is kept under ~/.cache/kvserve/tokenizers, keyed by the source
files' paths, sizes and modification times, and read back from there. Importing transformers and
building its tokenizer took 4-5 s of a 0.5B model's start-up; reading the kept ``tokenizer.json``
takes the Rust library well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import tokenizers

# Written last into a converted folder: its presence says the folder is whole.
INFO_FILE = "kvserve_tokenizer.json"
# The files HF's loader reads from a model folder; their sizes and times key the converted copy.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


class TokenizerInfo(NamedTuple):
    """What transformers adds around the Rust tokenizer: the special tokens by role (the chat
    template reads them), whether decoding cleans up spaces, and the chat template."""
    special_tokens: dict[str, str]
    clean_up_spaces: bool
    chat_template: str | None


def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization, for the WordPiece-era tokenizers that ask for it
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


class Tokenizer:
    """A model's tokenizer: text <-> token ids and the chat template.

    Immutable once built: encoding and decoding only read the Rust tokenizer, so the engine
    thread and the server's handlers share one instance (transformers' fast tokenizers set
    truncation and padding on every call, which is why they could not be shared).
    """

    def __init__(self, backend: tokenizers.Tokenizer, info: TokenizerInfo, source: Path | None = None) -> None:
        self.backend, self.info, self.source = backend, info, source
        self.chat_template = info.chat_template

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """A folder this module converted (``tokenizer.json`` and the info file)."""
        raw = json.loads((folder / INFO_FILE).read_text())
        info = TokenizerInfo(dict(raw["special_tokens"]), bool(raw["clean_up_spaces"]), raw["chat_template"])
        return cls(tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), info, folder)

    @classmethod
    def from_transformers(cls, hf: Any) -> Tokenizer:
        """The Rust tokenizer inside a transformers fast tokenizer, with what transformers adds."""
        backend = hf.backend_tokenizer
        cleans = bool(getattr(hf, "clean_up_tokenization_spaces", False))
        if cleans and type(backend.model).__name__ == "BPE":  # transformers skips it for BPE unless forced
            cleans = bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                  False))
        special = {role: str(token) for role, token in hf.special_tokens_map.items() if isinstance(token, str)}
        return cls(tokenizers.Tokenizer.from_str(backend.to_str()), TokenizerInfo(special, cleans, hf.chat_template))

    # ------------------------------------------------------------------ text and ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.info.clean_up_spaces else text

    def token_to_id(self, token: str) -> int | None:
        """A token's id; None for a token not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @cached_property
    def _vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def _special_id(self, role: str) -> int | None:
        token = self.info.special_tokens.get(role)
        return self.backend.token_to_id(token) if token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False) -> str:
        """The conversation rendered as transformers renders it (tokenize=False): the same jinja
        sandbox and filters, with the special tokens by role in scope. Raises ValueError if the
        model has no template and jinja2's TemplateError where the template refuses the input."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return _compiled_template(self.chat_template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **self.info.special_tokens)

    # ------------------------------------------------------------------ others' views

    def llguidance(self, n_vocab: int) -> Any:
        """llguidance's view of this tokenizer, for grammar-constrained decoding (~1 s to build)."""
        import llguidance

        return llguidance.LLTokenizer(self.backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_id)

    def save_pretrained(self, folder: str | Path) -> None:
        """Writes the tokenizer as transformers (and so vLLM) reads it from a model folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.source is not None:
            for item in self.source.iterdir():
                if item.is_file():
                    shutil.copyfile(item, folder / item.name)
            if self.chat_template is not None:  # the one in use: a fallback (Gemma's) is not in the source
                (folder / "chat_template.jinja").write_text(self.chat_template)
            return
        self.backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            **self.info.special_tokens, "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": self.info.clean_up_spaces, "chat_template": self.chat_template}))


def chat_token_ids(tokenizer: Tokenizer | None, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids of ``messages`` in the model's chat template, as the server encodes them
    (the rendered text, no extra BOS: the template has its own); ``tools`` go to the template as
    HF templates take them (templates without tool support leave them out)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """A chat template compiled once, in transformers' environment: an immutable sandbox with
    trimmed blocks, loop controls, a tojson that keeps non-ASCII, raise_exception and strftime_now."""
    compiled = _TEMPLATES.get(source)
    if compiled is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        compiled = _TEMPLATES[source] = env.from_string(source)
    return compiled


# ---------------------------------------------------------------------- loading, converted once


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "tokenizers"


def _source_key(files: list[Path]) -> str:
    """Names the converted copy after the source files' paths, sizes and modification times."""
    parts = []
    for file in files:
        stat = file.stat()
        parts.append(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _convert(hf: Any, folder: Path) -> Tokenizer:
    """Keeps what transformers built in ``folder`` (its own files plus the info file, written
    last) and returns the tokenizer read back the fast way; without a writable cache, the
    tokenizer is built from the transformers object in memory."""
    tokenizer = Tokenizer.from_transformers(hf)
    with contextlib.suppress(OSError):
        hf.save_pretrained(str(folder))
        tokenizer.backend.save(str(folder / "tokenizer.json"))  # exactly the pipeline transformers runs
        info = tokenizer.info
        (folder / INFO_FILE).write_text(json.dumps({"special_tokens": info.special_tokens,
                                                    "clean_up_spaces": info.clean_up_spaces,
                                                    "chat_template": info.chat_template}))
        tokenizer.source = folder
    return tokenizer


def load_cached(files: list[Path], build: Callable[[], Any]) -> Tokenizer:
    """The tokenizer converted from ``files``: read from the cache when a whole copy is there,
    else ``build()`` (a transformers tokenizer) converted and kept."""
    folder = _cache_root() / _source_key(files)
    if (folder / INFO_FILE).exists():
        try:
            return Tokenizer.from_folder(folder)
        except Exception:  # a damaged copy (the Rust library raises bare Exceptions): convert again
            pass
    return _convert(build(), folder)
