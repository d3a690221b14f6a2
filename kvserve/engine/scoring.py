"""Teacher-forced scoring: the log-probabilities a served request would see at each position of
a given text, through the engine's own paged (and possibly quantized or evicting) KV cache.

It runs beside the scheduler, not through it: a scored text is prefilled in fixed chunks whose
ends the caller picks (a prompt's end for SnapKV), and the tokens after a prompt are forced,
not sampled. The engine must have no running request while it scores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kvserve.config import ConfigError
from kvserve.engine.request import Request
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.step_plan import ScheduledChunk

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

SCORED_REQUEST_ID = "score"


def score_chunks(engine: LLMEngine, tokens: list[int], chunk: int,
                 prompt_len: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """For each chunk of ``tokens``: (its start, log-probabilities [chunk tokens, vocab] of the
    token after each position). The chunk's blocks are held at each yield and freed at the end. A
    streaming engine evicts before each chunk, as it does before a served step. The first
    ``prompt_len`` tokens are the prompt: chunks end at its end, and an engine with
    kv_eviction=snapkv then compresses it as it compresses a served prompt after its prefill."""
    request = Request(SCORED_REQUEST_ID, list(tokens), SamplingParams(max_tokens=1), -1)
    compression = engine.eviction.request_compression(request.params)
    kv = engine.kv_manager
    starts = [*range(0, prompt_len, chunk), *range(prompt_len, len(tokens), chunk)]
    try:
        for start, end in zip(starts, [*starts[1:], len(tokens)], strict=True):
            if kv.window_of(request.request_id) is not None:
                engine.streaming_hook.evict(request)
            if not kv.allocate_slots(request.request_id, end):
                raise ConfigError(f"the KV budget cannot hold one window of {len(tokens)} tokens")
            engine.model.extend_rope(end)
            engine.kv_cache.prepare(kv.take_storage_work())
            chunk_plan = ScheduledChunk(request, end - start, blocks=kv.blocks_of(request.request_id))
            _, hidden = engine.runner.forward([chunk_plan])
            request.num_computed_tokens = end
            if end == prompt_len and compression is not None:
                engine.snapkv.compress_prompt(request, compression)
            with torch.inference_mode():  # hidden is an inference tensor (the runner's forward)
                logprobs = torch.log_softmax(engine.model.compute_logits(hidden), dim=-1)
            yield start, logprobs
    finally:
        kv.forget(request.request_id)
