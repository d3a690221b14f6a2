"""The re-plan alarm: is the live workload still the one a configuration was tuned for?

``kvserve tune`` records the workload it measured (``tuned-workload`` in kvserve.yaml). A server
started with it exports ``kvserve:config_drift`` (live / tuned, per quantity, over its recent
requests), and ``kvserve tune --check`` reads any server's /metrics and says, with numbers,
when to tune again. Seed §8: when contexts grow or concurrency rises, the parameters must be
re-tuned.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kvserve.config import ConfigError, json_object

RATIO_ALARM = 1.5  # a mean length this many times the tuned one (or 1/this) calls for a re-tune
PREFIX_ALARM = 0.5  # a prefix hit rate below this share of the tuned one does too


class TunedWorkload(NamedTuple):
    """What a configuration was tuned for (token counts per request; rates per second)."""

    mean_prompt_tokens: float
    p90_prompt_tokens: float
    mean_output_tokens: float
    p90_output_tokens: float
    prefix_share: float  # prompt tokens found in the prefix cache (0..1)
    knee_concurrency: float  # concurrency at the measured knee
    kv_capacity_tokens: int  # token slots of the tuned KV pool
    rate: float | None = None  # requests per second of the traffic trace (None: not timed)

    @property
    def mean_sequence_tokens(self) -> float:
        return self.mean_prompt_tokens + self.mean_output_tokens

    @classmethod
    def parse(cls, value: str | dict[str, Any], where: str = "tuned_workload") -> TunedWorkload:
        """From JSON text or a mapping; a ConfigError names a missing, unknown or bad field."""
        data = json_object(value, where) if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(cls._fields)}")
        unknown = sorted(set(data) - set(cls._fields))
        missing = [f for f in cls._fields if f not in data and f not in cls._field_defaults]
        if unknown or missing:
            raise ConfigError(f"{where}: " + (f"unknown field {unknown[0]!r}" if unknown else
                                              f"missing field {missing[0]!r}") +
                              f" (fields: {', '.join(cls._fields)})")
        for name, number in data.items():
            if number is None and name == "rate":
                continue
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
                    or number < 0:
                raise ConfigError(f"{where}: {name} must be a number >= 0, got {number!r}")
        return cls(**data)


class LiveWorkload(NamedTuple):
    """What a server sees: mean lengths of the requests it finished (recently, or since start)."""

    mean_prompt_tokens: float
    mean_output_tokens: float
    finished_requests: int
    prefix_hit_rate: float
    kv_usage: float  # 0..1
    num_preemptions: float  # since start
    num_waiting: float

    @property
    def mean_sequence_tokens(self) -> float:
        return self.mean_prompt_tokens + self.mean_output_tokens


class Drift(NamedTuple):
    quantity: str  # sequence_length, prompt_length, output_length, prefix_hit_rate
    ratio: float  # live / tuned (1: as tuned)
    alarm: bool
    message: str


def drifts(tuned: TunedWorkload, live: LiveWorkload) -> list[Drift]:
    """Each quantity's live / tuned ratio, and whether it calls for a re-tune, in words."""
    out = []
    fits = int(tuned.kv_capacity_tokens // max(live.mean_sequence_tokens, 1.0))
    for quantity, now, then in (("sequence_length", live.mean_sequence_tokens, tuned.mean_sequence_tokens),
                                ("prompt_length", live.mean_prompt_tokens, tuned.mean_prompt_tokens),
                                ("output_length", live.mean_output_tokens, tuned.mean_output_tokens)):
        ratio = now / then if then > 0 else 1.0
        alarm = live.finished_requests > 0 and (ratio >= RATIO_ALARM or ratio <= 1 / RATIO_ALARM)
        name = quantity.replace("_", " ")
        message = f"mean {name} is {now:.0f} tokens, {ratio:.2f}x the tuned {then:.0f}"
        if quantity == "sequence_length" and alarm:
            consequence = (f"expect preemptions above {fits} concurrent (the pool holds "
                           f"{tuned.kv_capacity_tokens:,} tokens; tuned knee: {tuned.knee_concurrency:g})"
                           if ratio > 1 else
                           f"the pool now fits {fits} such sequences, the tuned knee was "
                           f"{tuned.knee_concurrency:g}: max-num-seqs and the KV budget may be too small to use it")
            message += f"; {consequence}"
        out.append(Drift(quantity, ratio, alarm, message))
    ratio = live.prefix_hit_rate / tuned.prefix_share if tuned.prefix_share > 0 else 1.0
    alarm = live.finished_requests > 0 and tuned.prefix_share >= 0.1 and ratio < PREFIX_ALARM
    out.append(Drift("prefix_hit_rate", ratio, alarm,
                     f"prefix-cache hit rate is {100 * live.prefix_hit_rate:.0f}%, tuned for "
                     f"{100 * tuned.prefix_share:.0f}%" + ("; block size and prefix caching were chosen for "
                                                           "more sharing" if alarm else "")))
    return out


def verdict(tuned: TunedWorkload, live: LiveWorkload) -> tuple[bool, list[str]]:
    """(time to re-tune, the lines that say why, or that all is as tuned)."""
    found = drifts(tuned, live)
    lines = [("RE-TUNE: " if d.alarm else "ok: ") + d.message for d in found]
    if live.num_preemptions > 0:
        lines.append(f"note: {live.num_preemptions:.0f} preemptions since start (the tuned configuration had none "
                     f"up to its knee), KV usage now {100 * live.kv_usage:.0f}%, {live.num_waiting:.0f} waiting")
    if live.finished_requests == 0:
        lines.append("no finished requests yet: nothing to compare")
    return any(d.alarm for d in found), lines


def live_from_metrics(text: str) -> LiveWorkload:
    """A LiveWorkload from a kvserve server's /metrics text (means since it started)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    if "kvserve:kv_cache_usage_perc" not in values:
        raise ConfigError("these metrics are not a kvserve server's (no kvserve:kv_cache_usage_perc)")

    def mean(name: str) -> float:
        count = values.get(f"kvserve:{name}_count", 0.0)
        return values.get(f"kvserve:{name}_sum", 0.0) / count if count else 0.0

    return LiveWorkload(mean("request_prompt_tokens"), mean("request_generation_tokens"),
                        int(values.get("kvserve:request_prompt_tokens_count", 0)),
                        values.get("kvserve:prefix_cache_hit_rate", 0.0), values["kvserve:kv_cache_usage_perc"],
                        values.get("kvserve:num_preemptions_total", values.get("kvserve:num_preemptions", 0.0)),
                        values.get("kvserve:num_requests_waiting", 0.0))
