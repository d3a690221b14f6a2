"""Shared fixtures: the real default model (loaded once) and tiny random-weight models."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from kvserve.engine.loading import LoadedModel, load_model  # noqa: E402
from kvserve.model.cpu_build import LEVEL_NAMES, LEVELS, build_state, level  # noqa: E402
from kvserve.model.cpu_kernels import cpu_kernels, missing_flags, use_isa  # noqa: E402

# ---------------------------------------------------------------- the C++ ops at every ISA level

ISA_TESTS: dict[str, int] = {}  # level -> tests run with its ops


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "isa_levels(*names): the ISA levels an `isa` test runs at (default: all)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The ops of the level that runs are built before any test: a server a test starts in a
    subprocess then finds them cached, and a build error shows first."""
    cpu_kernels()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``isa`` runs once per level (those its isa_levels marker names)."""
    if "isa" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("isa_levels")
        metafunc.parametrize("isa", marker.args if marker else LEVEL_NAMES, indirect=True)


@pytest.fixture
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test runs with this level's C++ ops; skipped only where this CPU cannot run it."""
    name = request.param
    missing = missing_flags(level(name))
    if missing:
        pytest.skip(f"this CPU cannot run level {name} (no {', '.join(missing)})")
    with use_isa(name):
        ISA_TESTS[name] = ISA_TESTS.get(name, 0) + 1
        yield name


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per ISA level: built (or not), and tested here or why not."""
    for isa in LEVELS:
        missing = missing_flags(isa)
        ran = f"{ISA_TESTS.get(isa.name, 0)} tests ran with it" if not missing else \
            f"not tested: this CPU cannot run it (no {', '.join(missing)})"
        terminalreporter.write_line(f"C++ ops, level {isa.name}: {build_state(isa)}; {ran}")



@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    """Gemma 3 270M (the optional extra kvserve[gemma], which make test installs)."""
    return load_model("gemma-3-270m", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def smollm_float() -> LoadedModel:
    """The default model widened to float32 (--quantization none): where a test holds two paths
    to float32 rounding, which the GGUF path's int16 activations would blur."""
    return load_model("smollm2-135m", torch.device("cpu"), torch.float32, "none")


@pytest.fixture(scope="session")
def hf_smollm(smollm: LoadedModel) -> Any:
    from kvserve.quant.reference import load_reference

    return load_reference(smollm.path)


TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32),
    # Gemma 3's shape in small: one KV head of dim 256, a 2:1 sliding:full pattern, window 8
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6, sliding_window=8,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    # MLA (latent 32 + rope 16), MoE with 4 routed experts (2 per token) and a shared one, layer 0 dense
    "deepseek_v2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, num_hidden_layers=3),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, num_hidden_layers=3, n_group=2, topk_group=1),
}


def make_tiny_model(root: Path, arch: str, o_proj_scale: float = 1.0, **overrides: Any) -> Path:
    """A random-weight HF folder (config.json + safetensors) of the given architecture.
    ``o_proj_scale`` < 1 weakens attention's output, so the next token depends mostly on the
    current one: greedy decoding soon repeats itself (speculation then has drafts to accept)."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config,
    }[arch]
    kwargs: dict[str, Any] = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=512,
                                  tie_word_embeddings=arch != "llama", rms_norm_eps=1e-5)
    kwargs.update(TINY[arch])
    kwargs.update(overrides)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init give peaked, tie-free logits
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
        for name, buffer in model.named_buffers():  # V3's router correction bias: not all zeros
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(o_proj_scale)
    path = root / arch
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[str, Path] = {}

    def factory(arch: str = "llama", **overrides: Any) -> Path:
        key = arch + repr(sorted(overrides.items()))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return factory


def first_divergence_is_near_tie(ours: list[int], ref: list[int], ref_logprobs: list[torch.Tensor],
                                 tol: float = 1e-3) -> tuple[bool, str]:
    """Token-for-token equality, except a divergence where the reference's top-2
    log-probabilities differ by less than ``tol`` (a numerical near-tie)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top2 = ref_logprobs[i].topk(2).values
            gap = float(top2[0] - top2[1])
            return gap < tol, f"diverged at output token {i}: ours {a}, reference {b}, top-2 gap {gap:.2e}"
    if len(ours) != len(ref):
        return False, f"lengths differ: ours {len(ours)}, reference {len(ref)}"
    return True, "identical"


# ---------------------------------------------------------------- a live server (module-scoped)

MODEL = "smollm2-135m"
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(f"{base} did not come up in {seconds} s")


def serve_in_thread(app: Any) -> tuple[str, Callable[[], None]]:
    """Run an ASGI app under uvicorn on a free loopback port: (base URL, stop)."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, seconds=10)

    def stop() -> None:
        uv.should_exit = True
        thread.join(timeout=10)

    return base, stop


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[dict[str, Any]]:
    from kvserve.config import EngineConfig
    from kvserve.server.app import ServerConfig
    from kvserve.server.serve import build

    config = EngineConfig.from_settings(model=MODEL, kv_cache_memory="256MiB", max_num_seqs=32)
    engine, app = build(config, ServerConfig(model_name=MODEL, api_key=KEY, max_waiting=64), loaded=smollm)
    base, stop = serve_in_thread(app)
    yield {"base": base, "engine": engine, "app": app,
           "client": openai.OpenAI(base_url=base + "/v1", api_key=KEY)}
    stop()
    engine.shutdown()
