"""The ingress's /metrics: every replica's kvserve metrics, labelled by replica, in one text."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: dict[str, str]) -> list[Metric]:
    """One family per metric name, holding every replica's samples with a ``replica`` label
    (Prometheus wants one TYPE line per name). Families keep their first replica's help."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                target.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
    return list(merged.values())


def exposition(families: list[Metric], *registries: CollectorRegistry) -> bytes:
    """The Prometheus text of ``families`` followed by that of ``registries``."""
    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Merged(families))
    return generate_latest(merged) + b"".join(generate_latest(registry) for registry in registries)
