"""Command line: ``kvserve generate``, ``plan``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.cluster.config import MAX_KV_IMBALANCE, MAX_REQUEST_IMBALANCE, ROUTER_NAMES, ClusterConfig
from kvserve.config import (
    KV_EVICTION,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    ConfigError,
    read_jsonl_prompts,
)
from kvserve.config_file import add_config_args, check_engine_values, effective_config, file_defaults


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m", help="alias, .gguf file or HF folder (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="int8: linear layers in int8 (weights per output channel, activations per token at run "
                        "time, exact int32 sums on every CPU level); default: the model dtype")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block, power of two 1..256")
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (overrides utilization)")
    g.add_argument("--kv-offload-memory", default=None,
                   help="tier 1: keep prefix blocks the pool evicts in this much host memory, e.g. 8GiB")
    g.add_argument("--kv-offload-disk", default=None,
                   help="tier 2: a directory for the blocks tier 1 drops, found again after a restart")
    g.add_argument("--kv-offload-disk-size", default="10GiB", help="tier 2's capacity (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights+activations+KV (CPU: of RAM)")
    g.add_argument("--device-memory", default=None, help="device memory to plan against, e.g. 24GB")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8, int4")
    g.add_argument("--kv-scales", default=None,
                   help="calibration file from kvserve calibrate: static key scales (int8/int4), fp8 scales")
    g.add_argument("--kv-key-scales", default="auto", choices=["auto", "static", "block", "global"],
                   help="int8/int4 key scales: static (calibrated, needs --kv-scales), per block, or global "
                        "(one scale for all K and V, to measure the mistake); auto: static with --kv-scales")
    g.add_argument("--kv-cache-dtype-skip-layers", type=layer_list, default=(),
                   help="comma-separated layer indices kept in the model dtype, e.g. 0,29")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached blocks of shared prompt prefixes (default: on)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="admission order: arrival, or longest cached prefix first (bounded wait)")
    g.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=True,
                   help="admit a request only when the KV cache holds its whole prompt besides the prompts still "
                        "prefilling; off: admit on its first chunk (more requests start, more are preempted) "
                        "(default: on)")
    g.add_argument("--disable-cascade-attn", action="store_true",
                   help="read a prefix that every running sequence shares once per sequence (default: once per "
                        "decode step for all of them: cascade attention)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer: sliding-window layers keep every block too")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (methods: ngram, draft_model with "model", layer_skip)')
    g.add_argument("--kv-eviction", default="none", choices=KV_EVICTION,
                   help="streaming: keep the attention sinks and a recent window of every request's KV, free "
                        "the rest as it grows (StreamingLLM; memory bounded whatever --max-tokens); snapkv: "
                        "compress each prompt once after its prefill to --kv-compression-ratio of its tokens")
    g.add_argument("--kv-sink-tokens", type=int, default=4,
                   help="streaming: first tokens kept as attention sinks (whole blocks) (default: %(default)s)")
    g.add_argument("--kv-window", type=int, default=1024,
                   help="streaming: most recent tokens kept (default: %(default)s)")
    g.add_argument("--kv-compression-ratio", type=float, default=0.5,
                   help="snapkv: fraction of each prompt's tokens kept per KV head (default: %(default)s)")
    g.add_argument("--kv-observation-window", type=int, default=32,
                   help="snapkv: last prompt tokens whose attention scores the rest (default: %(default)s)")
    g.add_argument("--kv-compression-per-layer", action="store_true",
                   help="snapkv: keep one set of tokens per layer (attention summed over its KV heads) instead of "
                        "one per KV head; kept passkeys far better on SmolLM2 (docs/benchmarks.md)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                   help="swap: a preempted request's blocks go to tier 1 (--kv-offload-memory) and come back "
                        "without recompute; recompute when tier 1 is full (default: %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "quantization": args.quantization, "device": args.device,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory, "kv_offload_memory": args.kv_offload_memory,
        "kv_offload_disk": args.kv_offload_disk, "kv_offload_disk_size": args.kv_offload_disk_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "device_memory": args.device_memory, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "kv_cache_dtype": args.kv_cache_dtype, "kv_scales": args.kv_scales,
        "kv_cache_dtype_skip_layers": args.kv_cache_dtype_skip_layers, "kv_key_scales": args.kv_key_scales,
        "enable_prefix_caching": args.enable_prefix_caching,
        "scheduling_policy": args.scheduling_policy, "seed": args.seed, "preemption_mode": args.preemption_mode,
        "scheduler_reserve_full_isl": args.scheduler_reserve_full_isl,
        "disable_cascade_attn": args.disable_cascade_attn,
        "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager,
        "speculative_config": args.speculative_config, "kv_eviction": args.kv_eviction,
        "kv_sink_tokens": args.kv_sink_tokens, "kv_window": args.kv_window,
        "kv_compression_ratio": args.kv_compression_ratio, "kv_observation_window": args.kv_observation_window,
        "kv_compression_per_layer": args.kv_compression_per_layer,
    }


def read_prompts(path: Path) -> list[Any]:
    """Plain text: one prompt per line. JSONL: objects with "prompt", "text" or "messages"."""
    if not path.exists():
        raise ConfigError(f"--prompts-file {str(path)!r} does not exist")
    if path.suffix != ".jsonl":
        return [line for line in path.read_text().splitlines() if line.strip()]
    return read_jsonl_prompts(path)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    prompts: list[Any] = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts(Path(args.prompts_file))
    if not prompts:
        raise ConfigError("no prompts: give PROMPT arguments or --prompts-file")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    inputs: list[Any] = []
    for p in prompts:
        if isinstance(p, list) or args.chat:
            messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
            inputs.append(llm.apply_chat_template(messages))
        else:
            inputs.append(p)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        shown = prompt if isinstance(prompt, str) else json.dumps(prompt)[:200]
        print(f"--- [{i}] {shown}")
        print(out.text.strip())
        print(f"    ({len(out.prompt_token_ids)} prompt + {len(out.token_ids)} generated tokens, "
              f"finish={out.finish_reason}, preempted {out.num_preemptions}x, TTFT {out.metrics['ttft']:.2f}s)")
    generated = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f}s "
          f"({generated / elapsed:.1f} output tok/s)")
    print(llm.kv_stats())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.config import EngineConfig
    from kvserve.llm import _setup_logging
    from kvserve.server.app import ServerConfig
    from kvserve.server.serve import serve
    from kvserve.tune.drift import TunedWorkload

    if args.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be positive, got {args.max_waiting}")
    _setup_logging()
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    if args.max_logprobs < 0:
        raise ConfigError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
    if args.max_streaming_tokens < 1:
        raise ConfigError(f"--max-streaming-tokens must be positive, got {args.max_streaming_tokens}")
    tuned = TunedWorkload.parse(args.tuned_workload, "--tuned-workload") if args.tuned_workload else None
    server_config = ServerConfig(model_name=args.served_model_name or args.model, api_key=args.api_key,
                                 max_waiting=args.max_waiting, max_logprobs=args.max_logprobs,
                                 max_streaming_tokens=args.max_streaming_tokens, tuned_workload=tuned)
    if args.ray:
        cluster = ClusterConfig(num_replicas=args.num_replicas, router=args.router, ray_address=args.ray_address,
                                cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                                max_ongoing_requests=args.max_ongoing_requests,
                                max_request_imbalance=args.router_max_request_imbalance,
                                max_kv_imbalance=args.router_max_kv_imbalance)
        try:
            from kvserve.cluster.deploy import run
        except ImportError as exc:
            raise ConfigError(f"--ray needs Ray Serve: pip install 'kvserve[ray]' ({exc})") from exc
        return run(config, server_config, cluster, args.host, args.port)
    return serve(config, server_config, args.host, args.port)


def with_config_file(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, args: argparse.Namespace,
                     argv: list[str] | None) -> argparse.Namespace:
    """``args`` again with the --config file's values as ``command``'s defaults: the command
    line still wins."""
    if args.config is None:
        return args
    values = file_defaults(command, args.config)
    command.set_defaults(**values)
    args = parser.parse_args(argv)
    if args.command in ("generate", "serve"):
        check_engine_values(args.config, values, args.model, engine_kwargs(args))
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="KV-cache-first LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts with continuous batching")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--prompts-file", help="text file (one prompt per line) or .jsonl")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(gen)
    from kvserve.plan.cli import add_plan_args, cmd_plan

    planner = sub.add_parser("plan", help="capacity plan: KV bytes, fit verdict and what-if before you deploy")
    add_plan_args(planner)
    server = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    server.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    server.add_argument("--max-waiting", type=int, default=256, help="queue bound; beyond it requests get 503")
    server.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / top_logprobs a request may ask for (default: %(default)s)")
    server.add_argument("--max-streaming-tokens", type=int, default=32768,
                        help="most tokens a request with kv_eviction=streaming may generate; such a request may run "
                             "past --max-model-len (default: %(default)s)")
    server.add_argument("--tuned-workload", default=None,
                        help="JSON (a mapping in a --config file): the workload kvserve tune measured; /metrics then "
                             "exports kvserve:config_drift and config_retune_needed")
    scale = server.add_argument_group("scale-out on Ray Serve (optional extra kvserve[ray])")
    scale.add_argument("--ray", action="store_true", help="serve --num-replicas engines as Ray Serve replicas")
    scale.add_argument("--num-replicas", type=int, default=2)
    scale.add_argument("--router", default="kv-aware", choices=ROUTER_NAMES,
                       help="replica choice: longest expected cached prefix within load bounds (kv-aware), Ray's "
                            "default (power-of-two) or in turn (default: %(default)s)")
    scale.add_argument("--ray-address", default=None, help="a running cluster (auto, HOST:6379); default: start one")
    scale.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs (and torch threads) per replica")
    scale.add_argument("--gpus-per-replica", type=float, default=0.0, help="0 with a CUDA --device: one each")
    scale.add_argument("--max-ongoing-requests", type=int, default=320,
                       help="per replica; past it Ray routes elsewhere (default: %(default)s)")
    scale.add_argument("--router-max-request-imbalance", type=float, default=MAX_REQUEST_IMBALANCE,
                       help="kv-aware: requests a replica may have over the least-loaded one and still win on its "
                            "cached prefix (default: %(default)s)")
    scale.add_argument("--router-max-kv-imbalance", type=float, default=MAX_KV_IMBALANCE,
                       help="kv-aware: the same bound on KV usage, a fraction; 1 is off (default: %(default)s)")
    add_engine_args(server)
    from kvserve.bench.cli import add_bench_args, cmd_bench
    from kvserve.quant.calibrate import add_calibrate_args, cmd_calibrate
    from kvserve.quant.evaluate import add_eval_args, cmd_eval

    add_calibrate_args(sub.add_parser("calibrate", help="KV quantization scales from your data; --check another"))
    evaluator = sub.add_parser("eval", help="KV quantization quality: PPL, KL, top-1, bytes, concurrency")
    add_eval_args(evaluator)
    bench_serve = add_bench_args(sub.add_parser("bench", help="load-test a server: sweep, knee, plots; compare runs"))
    from kvserve.tune.cli import add_tune_args, cmd_tune

    add_tune_args(sub.add_parser("tune", help="search the configuration for your workload and SLO; --check it "
                                              "against a live server"))
    configurable = {"generate": gen, "serve": server, "eval": evaluator, "bench serve": bench_serve}
    for command_parser in configurable.values():
        add_config_args(command_parser)
    args = parser.parse_args(argv)
    try:
        command = " ".join(filter(None, (args.command, getattr(args, "bench_command", None))))
        if command in configurable:
            args = with_config_file(parser, configurable[command], args, argv)
            if args.print_config:
                print(effective_config(configurable[command], args), end="")
                return 0
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "tune":
            return cmd_tune(args)
    except ValueError as e:  # ConfigError, InvalidRequestError, ModelLoadError
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
