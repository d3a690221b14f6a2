"""Structured output: a request's tokens kept inside a grammar (a JSON schema, a regex, a choice
of strings or a Lark grammar), as vLLM's structured outputs.

The grammar library is llguidance (guidance-ai's, one of vLLM's backends and llama.cpp's): it
has no dependencies (xgrammar, vLLM's default, requires triton on Linux x86-64, a GPU compiler a
CPU engine has no use for), compiles a JSON schema in about a millisecond and computes a
request's allowed-token mask over a 49k vocabulary in ~80 us on a CPU core.

Invariants: a Grammar has consumed exactly the request's output tokens; ``mask`` leaves the
tokens that keep the output a prefix of some string of the grammar (EOS once it is complete),
and only EOS when nothing else can follow (a grammar that can never be satisfied ends the
request instead of filling its row with -inf)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import torch

from kvserve.model.tokenizer import Tokenizer

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class StructuredOutput(NamedTuple):
    """What a request's output must match: ``kind`` one of STRUCTURED_KINDS, ``spec`` a JSON
    schema (as JSON text), a regex, a JSON list of strings, or a Lark grammar."""

    kind: str
    spec: str


class GrammarError(ValueError):
    """The grammar does not compile; the message says why."""


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, eos_token_id: int, vocab_size: int) -> None:
        import llguidance.torch

        self._matcher, self._eos, self._vocab = matcher, eos_token_id, vocab_size
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """-inf, in place, at the tokens of ``logits`` [1, vocab] the grammar does not allow next."""
        import llguidance.torch

        if self._matcher.is_error() or self._matcher.is_stopped():
            eos = logits[0, self._eos].clone()
            logits.fill_(float("-inf"))
            logits[0, self._eos] = eos
            return
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        width = min(logits.shape[-1], self._vocab)
        llguidance.torch.apply_token_bitmask_inplace(logits[:, :width], self._bitmask)
        logits[:, width:] = float("-inf")

    def advance(self, token: int) -> None:
        if not (self._matcher.is_error() or self._matcher.is_stopped()):
            self._matcher.consume_token(token)


class GrammarCompiler:
    """Compiles requests' grammars over one tokenizer (its llguidance view built at first use)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._ll_tokenizer: Any = None

    def compile(self, output: StructuredOutput) -> Grammar:
        """A fresh Grammar for one request; GrammarError names what does not compile."""
        import llguidance

        if self.tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer")
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self.tokenizer.llguidance(self.vocab_size)
        try:
            grammar = _grammar_text(output)
        except ValueError as exc:  # llguidance's own complaint (a schema that is not JSON, a bad choice list)
            raise GrammarError(f"{output.kind}: {exc}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if failed:
            raise GrammarError(f"{output.kind}: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"{output.kind}: {matcher.get_error()}")
        return Grammar(matcher, self.eos_token_id, self.vocab_size)


def closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever an object lists its properties
    and says nothing about others, as xgrammar's strict mode (vLLM's default) reads a schema:
    a model held to the listed keys does not invent more of them until max_tokens cuts it off."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) if key not in ("enum", "const", "default", "examples") else value
              for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _grammar_text(output: StructuredOutput) -> str:
    import llguidance

    if output.kind == "json":  # compact JSON (no whitespace between tokens): a small model's whitespace never runs on
        schema = closed_objects(json.loads(output.spec))
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults={"whitespace_flexible": False}))
    if output.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(output.spec))
    if output.kind == "choice":
        choices = json.loads(output.spec)
        alternatives = " | ".join(json.dumps(choice) for choice in choices)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    if output.kind == "grammar":
        return str(llguidance.LLMatcher.grammar_from_lark(output.spec))
    raise GrammarError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {output.kind!r}")
