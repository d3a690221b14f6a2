"""Each token's own bytes and text, as OpenAI's logprobs report them.

A byte-level BPE vocabulary (GPT-2's, SmolLM2's, Llama 3's) spells every byte as a printable
character, and a multi-byte character is often split over tokens: decoding such a token alone
gives U+FFFD, whose bytes are not the token's. The token's bytes come from its spelling instead
(or from a sentencepiece byte token ``<0xE2>``); its text is those bytes as UTF-8 where they are
whole characters, else ``bytes:\\xe2\\x80`` (vLLM's spelling), so distinct tokens never share a
``top_logprobs`` key."""

from __future__ import annotations

import re
from functools import lru_cache

from kvserve.model.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the
    others are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenText:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        # byte-level vocabularies spell the space byte as U+0120 ("Ġ")
        self.byte_level = tokenizer is not None and tokenizer.token_to_id("Ġ") is not None
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        cached = self._bytes.get(token)
        if cached is not None:
            return cached
        if self.tokenizer is None:
            return str(token).encode()
        spelling = self.tokenizer.id_to_token(token)
        table = _byte_of_char()
        match = _BYTE_TOKEN.fullmatch(spelling) if isinstance(spelling, str) else None
        if match:
            raw = bytes([int(match.group(1), 16)])
        elif self.byte_level and isinstance(spelling, str) and all(ch in table for ch in spelling):
            raw = bytes(table[ch] for ch in spelling)
        else:
            raw = str(self.tokenizer.decode([token])).encode()
        self._bytes[token] = raw
        return raw

    def text(self, token: int) -> str:
        raw = self.bytes_of(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
