"""The offline Python API: ``LLM(...).generate(...)``, ``.stream(...)``, ``.kv_stats()``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any, cast

from kvserve.cache.kv_stats import KVCacheStats
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel
from kvserve.engine.output import RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.model.tokenizer import chat_token_ids

Prompt = str | list[int] | dict[str, Any]


def _setup_logging() -> None:
    logger = logging.getLogger("kvserve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s kvserve: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False




class LLM:
    """A paged-KV engine over one model. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str = "smollm2-135m", loaded: LoadedModel | None = None, **kwargs: Any) -> None:
        """``loaded`` (from ``kvserve.engine.engine.load_model``) reuses an already loaded model."""
        _setup_logging()
        self.engine = LLMEngine(EngineConfig.from_settings(model=model, **kwargs), loaded)
        self.tokenizer = self.engine.tokenizer

    @staticmethod
    def _unpack(prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            return str(prompt["prompt"])
        return prompt

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion under continuous batching; outputs in input order.

        All prompts are validated before any is queued, so a bad one leaves the engine clean."""
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
        batch = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        items = [self._unpack(p) for p in batch]
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"got {len(params_list)} sampling params for {len(items)} prompts")
        else:
            params_list = [sampling_params or SamplingParams()] * len(items)
        ids = []
        try:
            for item, params in zip(items, params_list, strict=True):
                ids.append(self.engine.add_request(item, params).request_id)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        wanted = set(ids)
        while len(finals) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finals[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per new token of this prompt (``.new_text`` is the delta)."""
        request = self.engine.add_request(self._unpack(prompt), sampling_params, stream=True)
        try:
            while not request.finished:
                for out in self.engine.step():
                    if out.request_id == request.request_id:
                        yield out
        finally:
            if not request.finished:
                self.engine.abort_request(request.request_id)

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.apply_chat_template(messages)], sampling_params)[0]

    def kv_stats(self) -> KVCacheStats:
        return self.engine.kv_stats()
