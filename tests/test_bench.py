"""kvserve bench against a live kvserve server on loopback (small counts): every output file,
consistent numbers, and `bench report` overlaying two runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.cli import main
from tests.conftest import KEY, MODEL

pytestmark = pytest.mark.slow


def _sweep(server: dict[str, Any], out: Path, dataset: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = main(["bench", "serve", "--base-url", server["base"], "--model", MODEL, "--api-key", KEY,
                 "--dataset", dataset, "--input-len", "16:48", "--output-len", "6:12", "--prefix-len", "64",
                 "--num-prefixes", "2", "--num-prompts", "6", "--concurrency", "1,2,4", "--out", str(out),
                 "--quiet"])
    assert code == 0, capsys.readouterr().err
    return dict(json.loads((out / "results.json").read_text()))


def test_sweep_writes_consistent_results(server: dict[str, Any], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    result = _sweep(server, tmp_path / "random", "random", capsys)
    for name in ("results.json", "results.csv", "report.md", "throughput.png", "latency.png", "memory.png"):
        assert (tmp_path / "random" / name).stat().st_size > 0, name
    assert result["schema_version"] == 1 and [lv["level"] for lv in result["levels"]] == [1, 2, 4]
    for level in result["levels"]:
        assert level["errors"] == 0 and level["requests"] == 6
        for request in level["requests_detail"]:
            assert 0 < request["ttft"] <= request["e2e"]
            assert 6 <= request["output_tokens"] <= 12  # ignore_eos: exactly what was asked, from usage
        assert level["output_tokens"] == sum(r["output_tokens"] for r in level["requests_detail"])
        assert level["peak_kv_usage"] > 0 and level["peak_rss_bytes"] > 0
        assert level["ttft_s"]["p50"] <= level["ttft_s"]["p99"] <= level["e2e_s"]["p99"]
    csv_rows = (tmp_path / "random" / "results.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + 3
    report = (tmp_path / "random" / "report.md").read_text()
    assert "knee" in report.lower() and "throughput.png" in report


def test_prefix_dataset_hits_and_report_overlays_two_runs(server: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    prefix = _sweep(server, tmp_path / "prefix", "prefix", capsys)
    assert all((lv["prefix_hit_rate"] or 0) > 0 for lv in prefix["levels"])
    _sweep(server, tmp_path / "random", "random", capsys)
    assert main(["bench", "report", str(tmp_path / "prefix"), str(tmp_path / "random"),
                 "--out", str(tmp_path / "cmp")]) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "## prefix" in report and "## random" in report
    assert (tmp_path / "cmp" / "latency.png").stat().st_size > 0


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0,2"], "levels must be positive integers"),
    (["--concurrency", "1", "--request-rate", "2"], "not both"),
    (["--input-len", "9:3"], "--input-len"),
    (["--output-len", "normal:0:5"], "normal:MEAN:STD"),
    (["--dataset", "jsonl:/no/such.jsonl"], "does not exist"),
])
def test_bad_bench_input_exits_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *args]) == 2
    assert message in capsys.readouterr().err


def test_multiturn_dataset_resends_the_whole_history() -> None:
    from kvserve.bench.datasets import build_samples

    samples = build_samples("multiturn", 8, "5:9", "3:6", prefix_len=20, seed=1)
    for conversation in (samples[:4], samples[4:]):
        prompts = [s.prompt for s in conversation]
        assert all(isinstance(p, list) for p in prompts)
        for earlier, later, turn in zip(prompts, prompts[1:], conversation, strict=False):
            assert isinstance(earlier, list) and isinstance(later, list)
            # the next turn = this turn + its answer (max_tokens tokens) + a new user turn of 5..9 tokens
            assert later[: len(earlier)] == earlier
            assert 5 <= len(later) - len(earlier) - turn.max_tokens <= 9
    assert samples[0].prompt[:20] != samples[4].prompt[:20]  # type: ignore[index]
    assert [s.follows for s in samples] == [None, 0, 1, 2, None, 4, 5, 6]


def test_a_conversations_next_turn_waits_for_the_answer(server: dict[str, Any]) -> None:
    import asyncio

    from kvserve.bench.datasets import build_samples
    from kvserve.bench.loadgen import run_level

    samples = build_samples("multiturn", 8, "8", "6", prefix_len=16, seed=2)
    results, _, _ = asyncio.run(run_level(server["base"], MODEL, samples, concurrency=8, api_key=KEY))
    assert all(r.ok for r in results)
    for sample, result in zip(samples, results, strict=True):
        if sample.follows is not None:  # sent after the previous turn's last token, not beside it
            earlier = results[sample.follows]
            assert result.start >= earlier.start + earlier.e2e
    # the two conversations ran beside each other
    assert results[4].start < results[0].start + results[0].e2e


def test_max_duration_cancels_what_is_pending(server: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--base-url", server["base"], "--model", MODEL, "--api-key", KEY,
                 "--input-len", "16", "--output-len", "200", "--num-prompts", "4", "--concurrency", "1",
                 "--max-duration", "1.5", "--out", str(tmp_path / "cut"), "--quiet"])
    assert code == 0
    level = json.loads((tmp_path / "cut" / "results.json").read_text())["levels"][0]
    assert 1 <= level["errors"] <= 4 and any("max-duration" in e for e in level["error_samples"])
    assert level["duration_s"] < 10
    # the cancelled streams were disconnects: the server aborted them and took their blocks back
    import time

    deadline = time.time() + 1.0
    while server["engine"].kv_stats.blocks_used and time.time() < deadline:
        time.sleep(0.05)
    assert server["engine"].kv_stats.blocks_used == 0


def test_length_distributions() -> None:
    import random

    from kvserve.bench.datasets import LengthSpec

    rng = random.Random(0)
    assert {LengthSpec("7", "x").draw(rng) for _ in range(20)} == {7}
    assert {LengthSpec("3:5", "x").draw(rng) for _ in range(200)} == {3, 4, 5}
    draws = [LengthSpec("normal:100:10", "x").draw(rng) for _ in range(2000)]
    assert 98 < sum(draws) / len(draws) < 102 and min(draws) >= 1


def test_jsonl_levels_take_successive_rows(tmp_path: Path) -> None:
    """Each level of a sweep sends the next --num-prompts rows of a jsonl file, wrapping only when
    the file runs out: replaying the same rows let every level after the first find its prompts
    in the prefix cache (3x the request rate on the recorded classify session)."""
    from kvserve.bench.datasets import build_samples

    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}", "max_tokens": 4}) + "\n" for i in range(10)))
    levels = [build_samples(f"jsonl:{path}", 4, "8", "4", offset=i * 4) for i in range(3)]
    assert [[s.prompt for s in level] for level in levels] == [
        ["row 0", "row 1", "row 2", "row 3"], ["row 4", "row 5", "row 6", "row 7"],
        ["row 8", "row 9", "row 0", "row 1"]]
