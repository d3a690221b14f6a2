"""Tool calls in OpenAI's shape: the grammar that forces them, and the calls read back from the
generated text.

``tool_choice`` decides: a named function constrains the output to that function's arguments
(a JSON object of its ``parameters`` schema); ``required`` to a JSON array of one or more calls
``{"name", "arguments"}`` of the tools given; ``auto`` (the default with tools) leaves the model
free, and calls it writes as Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks (the format of Qwen's, SmolLM3's and NousResearch's templates) are read back; ``none``
generates text. Every call gets an id of its own."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from kvserve.engine.structured import StructuredOutput

_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class ToolCalls(NamedTuple):
    """What a chat turn said: its text (None when it only called tools) and its calls."""

    content: str | None
    calls: list[dict[str, Any]]


def forced_calls_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> StructuredOutput | None:
    """The grammar ``choice`` imposes (``tools``: OpenAI function specs): None for auto/none."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        (function,) = [t["function"] for t in tools if t["function"]["name"] == name]
        return StructuredOutput("json", json.dumps(function.get("parameters") or {"type": "object"}))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                    "arguments": t["function"].get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return StructuredOutput("json", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}}))
    return None


def read_tool_calls(text: str, tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> ToolCalls:
    """The calls in a turn generated under ``choice`` (forced turns are valid JSON by their
    grammar, unless cut short by max_tokens: then the text stays text)."""
    names = {t["function"]["name"] for t in tools}
    try:
        if isinstance(choice, dict):
            json.loads(text)
            return ToolCalls(None, [_call(choice["function"]["name"], text)])
        if choice == "required":
            return ToolCalls(None, [_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)])
    except (ValueError, KeyError, TypeError):
        return ToolCalls(text, [])
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            call = json.loads(block)
            if call.get("name") in names:
                calls.append(_call(call["name"], json.dumps(call.get("arguments", {}))))
        except (ValueError, AttributeError):
            continue
    if not calls:
        return ToolCalls(text, [])
    rest = _HERMES_CALL.sub("", text).strip()
    return ToolCalls(rest or None, calls)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
