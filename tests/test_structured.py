"""Structured output's pieces: grammars over SmolLM2's real tokenizer (llguidance), drafts checked
against them in verification, and tool calls read back from generated text."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.engine.loading import LoadedModel
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.spec_decode import verify
from kvserve.engine.structured import GrammarCompiler, GrammarError, StructuredOutput
from kvserve.server.tools import read_tool_calls


@pytest.fixture(scope="module")
def compiler(smollm: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(smollm.tokenizer, smollm.config.vocab_size, smollm.tokenizer.eos_token_id)


def one_token(smollm: LoadedModel, text: str) -> int:
    (token,) = smollm.tokenizer.encode(text, add_special_tokens=False)
    return int(token)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_outside_the_grammar_never_stands(smollm: LoadedModel, compiler: GrammarCompiler,
                                                  greedy: bool) -> None:
    """The model (its logits) wants "no" at every position and the proposer drafted it, but the
    grammar allows only "yes": the draft falls, "yes" comes out, then only EOS."""
    yes, no, eos = one_token(smollm, "yes"), one_token(smollm, "no"), smollm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=0)
    generator = None if greedy else torch.Generator().manual_seed(0)
    logits = torch.zeros(3, smollm.config.vocab_size)
    logits[:, no] = 30.0
    grammar = compiler.compile(StructuredOutput("choice", json.dumps(["yes"])))
    assert verify(logits, [no, no], params, generator, None, grammar).token_ids == [yes]
    allowed = logits[:1].clone()
    grammar.mask(allowed)
    assert torch.isfinite(allowed).nonzero()[:, 1].tolist() == [eos]  # complete: only EOS may follow


def test_a_draft_inside_the_grammar_stands(smollm: LoadedModel, compiler: GrammarCompiler) -> None:
    yes, no, eos = one_token(smollm, "yes"), one_token(smollm, "no"), smollm.tokenizer.eos_token_id
    logits = torch.zeros(2, smollm.config.vocab_size)
    logits[0, no] = 30.0
    grammar = compiler.compile(StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert verify(logits, [no], SamplingParams(temperature=0.0), None, None, grammar).token_ids == [no, eos]
    assert yes != no


@pytest.mark.parametrize("output,fragment", [
    (StructuredOutput("json", "{not json"), "json"),
    (StructuredOutput("regex", "(unclosed"), "regex"),
    (StructuredOutput("grammar", "start: undefined_rule"), "grammar"),
])
def test_a_grammar_that_does_not_compile_is_an_error_naming_its_kind(compiler: GrammarCompiler,
                                                                    output: StructuredOutput, fragment: str) -> None:
    with pytest.raises(GrammarError, match=fragment):
        compiler.compile(output)


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_tool_calls_are_read_back_from_text() -> None:
    """auto: Hermes-style blocks naming a known tool become calls, the text around them stays
    content; unknown names and broken JSON stay text. Forced calls parse their JSON."""
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    said = read_tool_calls(text, TOOLS, "auto")
    assert said.content == "Let me check." and len(said.calls) == 1
    assert json.loads(said.calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert read_tool_calls('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS, "auto").calls == []
    assert read_tool_calls("<tool_call>{broken</tool_call>", TOOLS, "auto").calls == []
    forced = read_tool_calls('[{"name": "get_time", "arguments": {"zone": "CET"}}]', TOOLS, "required")
    assert forced.content is None and forced.calls[0]["function"]["name"] == "get_time"
    cut = read_tool_calls('{"zone": "CE', TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert cut.calls == [] and cut.content == '{"zone": "CE'  # cut short by max_tokens: text stays text


def test_objects_that_list_their_properties_are_closed() -> None:
    """As xgrammar's strict mode (vLLM's default): listed properties only, unless the schema says
    otherwise; enum and const values are data, left alone."""
    from kvserve.engine.structured import closed_objects

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"const": {"properties": 1}}}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["properties"]["k"]["const"] == {"properties": 1}
    assert closed["properties"]["open"]["additionalProperties"] is True
