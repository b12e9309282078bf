"""`BatchHistogram`: a batch observed at once exposes what prometheus_client's `Histogram`
exposes after observing the same values one by one (the buckets, the count and the sum), in
the text and OpenMetrics formats, and leaves out what `Metrics.observe_finished` always left out."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from pipeline.metrics import SESSION_BUCKETS, BatchHistogram

EDGES = [0.0, -0.0, 0.01, 0.010000001, 1.0, 14400.0, 14400.5, 1e9]
LEFT_OUT = [None, -1.0, -1e-12, math.nan, math.inf, -math.inf]


def _samples(registry: CollectorRegistry) -> dict:
    """`{(sample name, labels): value}` of the text exposition, without `_created`."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_exposes_what_one_by_one_observations_expose(seed):
    rng = random.Random(seed)
    batches = [[rng.choice([*EDGES, *LEFT_OUT, *SESSION_BUCKETS, rng.lognormvariate(0, 3)])
                for _ in range(rng.randrange(0, 300))] for _ in range(4)]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("d_seconds", "doc", ("shard", "kind"), SESSION_BUCKETS, ours)
    reference = Histogram("d_seconds", "doc", ("shard", "kind"), buckets=SESSION_BUCKETS, registry=theirs)
    for i, values in enumerate(batches):
        labels = (str(i % 2), "a")
        batch.observe_many(labels, values)
        for v in values:  # what `Metrics.observe_finished` observed, one at a time
            if v is not None and math.isfinite(v) and v >= 0:
                reference.labels(*labels).observe(v)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert any(name.endswith("_bucket") and v > 0 for (name, _), v in got.items())


def test_exposed_as_a_histogram_in_both_formats():
    registry = CollectorRegistry(auto_describe=True)
    h = BatchHistogram("d_seconds", "Durations.", ("shard",), (0.5, 2.0), registry)
    h.observe_many(("0",), [0.5, 0.6, 3.0, None])
    text = generate_latest(registry).decode()
    assert "# TYPE d_seconds histogram" in text
    assert 'd_seconds_bucket{le="0.5",shard="0"} 1.0' in text
    assert 'd_seconds_bucket{le="2.0",shard="0"} 2.0' in text
    assert 'd_seconds_bucket{le="+Inf",shard="0"} 3.0' in text
    assert 'd_seconds_count{shard="0"} 3.0' in text
    assert 'd_seconds_sum{shard="0"} 4.1' in text
    assert "d_seconds_count" in generate_openmetrics(registry).decode()
    assert registry.get_sample_value("d_seconds_bucket", {"shard": "0", "le": "+Inf"}) == 3


def test_nothing_observed_leaves_no_series_and_refuses_wrong_labels_and_buckets():
    registry = CollectorRegistry()
    h = BatchHistogram("d_seconds", "doc", ("shard",), (1.0,), registry)
    h.observe_many(("0",), [None, -2.0, math.nan])
    assert registry.get_sample_value("d_seconds_count", {"shard": "0"}) is None
    with pytest.raises(ValueError, match="label names"):
        h.observe_many(("0", "x"), [1.0])
    for buckets in [(2.0, 1.0), (1.0, 1.0), (1.0, math.inf)]:
        with pytest.raises(ValueError, match="finite and increasing"):
            BatchHistogram("e_seconds", "doc", (), buckets, None)
