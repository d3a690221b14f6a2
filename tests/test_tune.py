"""kvserve tune: a budgeted, resumable search on the default model whose kvserve.yaml a server
starts with, and the re-plan alarm (tune --check, kvserve:config_drift)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.datasets import Sample
from kvserve.cli import main
from kvserve.config import ConfigError
from kvserve.tune.cli import candidates, parse_slo
from kvserve.tune.drift import LiveWorkload, TunedWorkload, drifts, verdict
from kvserve.tune.search import serving
from kvserve.tune.workload import prefix_share, prompt_ids, workload_stats

TINY = ["--workload", "random", "--num-prompts", "20", "--input-len", "32:64", "--output-len", "8:16",
        "--block-sizes", "16,32", "--kv-cache-dtypes", "auto", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "512", "--concurrency", "1,2", "--prompts-per-level", "2", "--memory", "64MiB",
        "--slo", "ttft_p99=10s,tpot_p99=2s", "--quiet"]


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return float(sample.value)
    raise KeyError(name)


def test_tune_resumes_writes_a_config_a_server_starts_with_and_check_flags_doubled_lengths(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tuned"
    # a budget spent after the first measurement: the search stops, what it measured is on disk
    assert main(["tune", *TINY, "--time-budget", "1ms", "--out", str(out)]) == 0
    first = [json.loads(line) for line in (out / "candidates.jsonl").read_text().splitlines()]
    assert len(first) == 1 and first[0]["rung"] == 0 and first[0]["error"] is None
    capsys.readouterr()
    # again with time: the first candidate is not measured again; two at rung 0, the better at rung 1
    assert main(["tune", *TINY, "--time-budget", "10m", "--out", str(out)]) == 0
    results = [json.loads(line) for line in (out / "candidates.jsonl").read_text().splitlines()]
    assert results[0] == first[0] and [(r["rung"]) for r in results] == [0, 0, 1]
    assert {r["name"] for r in results[:2]} == {"bs16-auto-seqs4-mbt512", "bs32-auto-seqs4-mbt512"}
    rung0 = sorted(results[:2], key=lambda r: r["goodput"], reverse=True)
    assert results[2]["name"] == rung0[0]["name"] and all(lv["requests"] == 4 for lv in results[2]["levels"])
    assert "chosen: " + results[2]["name"] in capsys.readouterr().out
    text = (out / "kvserve.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["block-size"] == results[2]["flags"]["block-size"] and config["enable-prefix-caching"] is False
    assert "# best goodput (req/s) at the first rung, by value: 16: " in text
    assert "# workload assumed: 20 requests" in text
    tuned = TunedWorkload.parse(config["tuned-workload"])
    assert tuned.kv_capacity_tokens > 0 and 30 < tuned.mean_prompt_tokens < 70 and tuned.prefix_share == 0
    report = (out / "report.md").read_text()
    assert results[2]["name"] in report and (out / "goodput.png").stat().st_size > 0

    with serving(out / "kvserve.yaml", tmp_path / "server.log") as base_url:
        metrics = httpx.get(f"{base_url}/metrics").text
        assert metric(metrics, "kvserve:config_retune_needed") == 0
        check = ["tune", "--check", str(out / "kvserve.yaml"), "--metrics-url", f"{base_url}/metrics"]
        assert main(check) == 0 and "nothing to compare" in capsys.readouterr().out
        for _ in range(3):  # prompts and outputs twice the tuned lengths
            body = {"model": "smollm2-135m", "prompt": list(range(100, 100 + 2 * round(tuned.mean_prompt_tokens))),
                    "max_tokens": 2 * round(tuned.mean_output_tokens), "ignore_eos": True}
            assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(f"{base_url}/metrics").text
        ratio = metric(metrics, "kvserve:config_drift", {"quantity": "sequence_length"})
        assert 1.9 < ratio < 2.1 and metric(metrics, "kvserve:config_retune_needed") == 1
        assert main(check) == 1
    said = capsys.readouterr().out
    assert "RE-TUNE: mean sequence length is" in said and "x the tuned" in said and "expect preemptions above" in said
    assert "time to re-tune" in said


def tuned(**changes: float) -> TunedWorkload:
    base = TunedWorkload(500, 900, 100, 200, 0.4, 16, 16_000)
    return base._replace(**changes)


def live(prompt: float, output: float, hit_rate: float = 0.4, finished: int = 50) -> LiveWorkload:
    return LiveWorkload(prompt, output, finished, hit_rate, 0.5, 0, 0)


def test_drift_says_when_and_why_to_retune() -> None:
    same = verdict(tuned(), live(520, 95))
    assert same[0] is False and all(line.startswith("ok: ") for line in same[1])
    longer = {d.quantity: d for d in drifts(tuned(), live(1200, 180))}
    seq = longer["sequence_length"]
    assert seq.alarm and seq.ratio == pytest.approx(1380 / 600)
    assert "1380 tokens, 2.30x the tuned 600" in seq.message
    assert "expect preemptions above 11 concurrent (the pool holds 16,000 tokens; tuned knee: 16)" in seq.message
    shorter = {d.quantity: d for d in drifts(tuned(), live(150, 30))}
    assert shorter["sequence_length"].alarm
    assert "the pool now fits 88 such sequences" in shorter["sequence_length"].message
    cold = {d.quantity: d for d in drifts(tuned(), live(500, 100, hit_rate=0.1))}
    assert cold["prefix_hit_rate"].alarm and not cold["sequence_length"].alarm
    assert not any(d.alarm for d in drifts(tuned(), live(5000, 5000, finished=0)))  # nothing finished yet


@pytest.mark.parametrize("value,message", [
    ('{"mean_prompt_tokens": 1}', "missing field 'p90_prompt_tokens'"),
    ({**tuned()._asdict(), "color": 1}, "unknown field 'color'"),
    ({**tuned()._asdict(), "prefix_share": -1}, "prefix_share must be a number >= 0"),
    ("{nope", "not valid JSON"),
])
def test_tuned_workload_errors_name_the_field(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TunedWorkload.parse(value)  # type: ignore[arg-type]


def test_slo_and_workload_statistics() -> None:
    assert parse_slo("ttft_p99=2s,tpot_p99=150ms") == (2.0, 0.15)
    assert parse_slo("tpot_p99=0.5m") == (None, 30.0)
    for bad in ("ttft=2s", "ttft_p99=fast"):
        with pytest.raises(ConfigError, match="--slo"):
            parse_slo(bad)
    shared = list(range(1000, 1048))  # three blocks of 16
    prompts = [[*shared, 1, 2, 3], shared + [4] * 20, [9] * 40]
    # the second prompt finds the first's 3 full blocks; the others nothing
    assert prefix_share(prompts) == pytest.approx(48 / (51 + 68 + 40))
    stats = workload_stats(prompts, [Sample(p, None, n) for p, n in zip(prompts, (10, 20, 30), strict=True)])
    assert stats.mean_output_tokens == 20 and stats.p90_prompt_tokens == 68


def test_the_plan_prunes_what_cannot_fit() -> None:
    prompts = [[i] * 900 for i in range(10)]  # 1,000-token sequences, nothing shared
    stats = workload_stats(prompts, [Sample(p, None, 100) for p in prompts])
    args = Namespace(block_sizes="16,64", max_num_seqs="2,8,32", max_num_batched_tokens="512")
    capacity = {(16, "auto"): 9_000, (64, "auto"): 900, (16, "int8"): 40_000, (64, "int8"): 40_000}
    grid, pruned = candidates(args, stats, ["auto", "int8"], capacity)
    names = {c.name for c in grid}
    assert names == {"bs16-auto-seqs2-mbt512", "bs16-auto-seqs8-mbt512", "bs16-int8-seqs2-mbt512",
                     "bs16-int8-seqs8-mbt512", "bs16-int8-seqs32-mbt512", "bs64-int8-seqs2-mbt512",
                     "bs64-int8-seqs8-mbt512", "bs64-int8-seqs32-mbt512"}
    assert any("block 64 auto: the pool holds 900 tokens, less than one p90 sequence" in p for p in pruned)
    assert any("block 16 auto: max-num-seqs 32 (the pool holds 9.0 mean sequences)" in p for p in pruned)
    # half of every prompt shared (prefix caching on): a sequence costs its unshared 550 tokens
    shared = [[7] * 448 + [i] * 452 for i in range(10)]
    shared_stats = workload_stats(shared, [Sample(p, None, 100) for p in shared])
    assert shared_stats.prefix_share > 0.4
    pool = {(16, "auto"): 20_000, (64, "auto"): 20_000}  # 20 whole sequences; 33 of their unshared parts
    unshared_grid, _ = candidates(args, stats, ["auto"], pool)
    assert "bs16-auto-seqs32-mbt512" not in {c.name for c in unshared_grid}
    grid, pruned = candidates(args, shared_stats, ["auto"], pool)
    assert "bs16-auto-seqs32-mbt512-pc" in {c.name for c in grid} and not pruned


def test_chat_requests_count_their_template_tokens(smollm: Any) -> None:
    """A chat request is measured in the tokens the server encodes (the rendered template), not
    in the keys of the mapping transformers returns for tokenize=True (the bug kvserve eval had
    with JSONL messages)."""
    messages = [{"role": "user", "content": "Classify this: hello there"}]
    ids = prompt_ids(Sample(None, messages, 4), smollm.tokenizer)
    assert all(isinstance(i, int) for i in ids) and len(ids) > 8
    assert "Classify this: hello there" in smollm.tokenizer.decode(ids)


def test_quality_keeps_the_dtypes_within_the_limit_on_the_workloads_text(smollm: Any, tmp_path: Path) -> None:
    """Each KV dtype scored on the workload's own prompts against the model dtype (fp8 with scales
    calibrated on them, written for the config); the limit decides what the search may try."""
    from kvserve.cache.kv_scales import KVScales
    from kvserve.quant.data import stdlib_docstrings
    from kvserve.tune.run import quality

    prompts = [list(smollm.tokenizer.encode(text))[:256] for text in stdlib_docstrings()[:6]]
    args = Namespace(eval_tokens=768, workload="docs.jsonl", quiet=True, model="smollm2-135m")
    allowed, lines, scales = quality(args, smollm, prompts, ["auto", "int8", "fp8_e4m3"], 1e6, tmp_path)
    assert allowed == ["auto", "int8", "fp8_e4m3"] and len(lines) == 3
    assert lines[1].startswith("int8: PPL ") and "kept" in lines[1]
    assert scales == tmp_path / "kv_scales.json"
    assert KVScales.load(scales).source == "kvserve tune --workload docs.jsonl"
    with pytest.raises(ConfigError, match="no KV dtype stays within --max-quality-loss"):
        quality(args, smollm, prompts, ["int8"], -1.0, tmp_path)


def test_the_winner_prefers_headroom_among_goodputs_within_noise() -> None:
    """Of the last rung, goodputs within 10% of the best are equal: the knee furthest right, then
    the larger max-num-seqs wins (the recorded session's 11.2 vs 10.2 req/s picked 16 over 64,
    which the full comparison reversed); a clearly better goodput still wins."""
    from kvserve.tune.search import best_result

    def result(name: str, goodput: float, knee: float | None, seqs: int, rung: int = 1) -> dict[str, Any]:
        return {"name": name, "rung": rung, "goodput": goodput, "knee": knee, "error": None,
                "flags": {"max-num-seqs": seqs}}

    session = [result("seqs16", 11.23, 8, 16), result("seqs64", 10.20, 8, 64), result("old", 50, 32, 64, rung=0)]
    assert best_result(session)["name"] == "seqs64"  # type: ignore[index]
    assert best_result([result("a", 12.0, 8, 16), result("b", 10.0, 8, 64)])["name"] == "a"  # type: ignore[index]
    assert best_result([result("a", 11.0, 8, 64), result("b", 10.5, 16, 16)])["name"] == "b"  # type: ignore[index]
    assert best_result([{"name": "x", "rung": 0, "error": "exited"}]) is None
    # no knee found: throughput kept paying to the highest level, the furthest right of all (the
    # second classify session picked max-num-seqs 16, knee 8, over 64 that scaled to 64: None read as 0)
    scaled = result("seqs64", 11.97, None, 64) | {"levels": [{"level": 1}, {"level": 64}]}
    assert best_result([result("seqs16", 12.71, 8, 16), scaled])["name"] == "seqs64"  # type: ignore[index]


def test_every_level_sends_whole_waves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A level sends at least min_waves x its concurrency, the rung's doubling above that: at 8
    prompts a level of 8 was one burst, and two identical configs measured 1.6x apart."""
    from kvserve.tune.search import SearchSpec, level_requests

    spec = SearchSpec({}, [], [1, 8, 64], None, None, tmp_path, 60.0, prompts_per_level=8, min_waves=4)
    assert [level_requests(spec, level, 0) for level in (1, 8, 64)] == [8, 32, 256]
    assert [level_requests(spec, level, 3) for level in (1, 8, 64)] == [64, 64, 256]
    assert main(["tune", "--workload", "random", "--min-waves", "0", "--out", str(tmp_path), "--quiet"]) != 0
    assert "--min-waves must be >= 1, got 0" in capsys.readouterr().err
