"""Command line: ``kvserve generate``, ``plan``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from kvserve.cluster.config import MAX_KV_IMBALANCE, MAX_REQUEST_IMBALANCE, ROUTER_NAMES, ClusterConfig
from kvserve.config import CONCERNS, ConfigError, EngineConfig, read_jsonl_prompts, setting_fields
from kvserve.config_file import add_config_args, check_engine_values, effective_config, file_defaults
from kvserve.config_reference import flag_name


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine setting, from its metadata (config.knob), grouped by concern."""
    groups = {concern: parser.add_argument_group(f"engine: {concern}") for concern in CONCERNS}
    for concern, setting in setting_fields():
        meta = setting.metadata
        names = [flag_name(setting.name)] + ([meta["short"]] if meta["short"] else [])
        options: dict[str, Any] = {"default": setting.default, "help": meta["help"]}
        if meta["choices"]:
            options["choices"] = meta["choices"]
        if isinstance(setting.default, bool):
            options["action"] = argparse.BooleanOptionalAction if setting.default else "store_true"
        elif isinstance(setting.default, tuple):
            options["type"] = layer_list
        elif (meta["kind"] or type(setting.default)) in (int, float):
            options["type"] = meta["kind"] or type(setting.default)
        groups[concern].add_argument(*names, **options)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings (EngineConfig.from_settings) from the parsed flags (the model apart)."""
    return {setting.name: getattr(args, setting.name) for _, setting in setting_fields() if setting.name != "model"}


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
    from kvserve.llm import _setup_logging
    from kvserve.server.app import ServerConfig
    from kvserve.server.serve import serve
    from kvserve.tune.drift import TunedWorkload

    if args.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be positive, got {args.max_waiting}")
    _setup_logging()
    config = EngineConfig.from_settings(model=args.model, **engine_kwargs(args))
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
                                max_kv_imbalance=args.router_max_kv_imbalance,
                                prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas)
        cluster.check_engine(config.offload_config.kv_offload_remote)
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


class Cli(NamedTuple):
    parser: argparse.ArgumentParser
    configurable: dict[str, argparse.ArgumentParser]  # the commands that take --config / --print-config


def build_parser() -> Cli:
    """kvserve's whole command line (the docs' commands are checked against it)."""
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
    from kvserve.plan.cli import add_plan_args

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
    scale.add_argument("--prefill-replicas", type=int, default=0,
                       help="prefill/decode disaggregation: replicas that only compute prompts, handing their KV to "
                            "--decode-replicas through --kv-offload-remote (default: off)")
    scale.add_argument("--decode-replicas", type=int, default=0,
                       help="with --prefill-replicas: replicas that decode (they replace --num-replicas)")
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
    from kvserve.bench.cli import add_bench_args
    from kvserve.quant.calibrate import add_calibrate_args
    from kvserve.quant.evaluate import add_eval_args

    add_calibrate_args(sub.add_parser("calibrate", help="KV quantization scales from your data; --check another"))
    evaluator = sub.add_parser("eval", help="KV quantization quality: PPL, KL, top-1, bytes, concurrency")
    add_eval_args(evaluator)
    bench_serve = add_bench_args(sub.add_parser("bench", help="load-test a server: sweep, knee, plots; compare runs"))
    from kvserve.tune.cli import add_tune_args

    add_tune_args(sub.add_parser("tune", help="search the configuration for your workload and SLO; --check it "
                                              "against a live server"))
    configurable = {"generate": gen, "serve": server, "eval": evaluator, "bench serve": bench_serve}
    for command_parser in configurable.values():
        add_config_args(command_parser)
    return Cli(parser, configurable)


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.cli import cmd_bench
    from kvserve.plan.cli import cmd_plan
    from kvserve.quant.calibrate import cmd_calibrate
    from kvserve.quant.evaluate import cmd_eval
    from kvserve.tune.cli import cmd_tune

    parser, configurable = build_parser()
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
