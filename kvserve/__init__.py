"""kvserve: a KV-cache-first LLM inference engine."""

from kvserve.cache.kv_stats import KVCacheStats
from kvserve.config import ConfigError, EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.output import RequestOutput
from kvserve.engine.request import InvalidRequestError
from kvserve.engine.sampling import SamplingParams
from kvserve.llm import LLM

__all__ = ["LLM", "ConfigError", "EngineConfig", "InvalidRequestError", "KVCacheStats", "LLMEngine",
           "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
