"""The admission consumer's metrics: each transaction's events, actions and results are
counted together once it committed (`Admission._observe`), to the same series and values
as one observation per entry would give."""

from __future__ import annotations

import pytest

from pipeline import wire
from pipeline.metrics import Metrics
from tests.integration.test_adm_read_ahead import _admission, _drain, _started

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("read_count", [3, 256])
def test_a_step_s_events_results_and_actions_are_each_counted_once(r, keys, redis_config, read_count):
    metrics = Metrics()
    adm = _admission(r, redis_config, read_count=read_count, metrics=metrics)
    _started(r, keys, adm)  # open, register, hand over step 0: eight first attempts submitted
    _drain(adm)  # their eight results (one second each): the step is emitted
    assert wire.from_fields(r.xrange(keys.ready(0))[0][1], wire.Ready).step == 0
    get = metrics.registry.get_sample_value
    s = {"shard": "0"}
    events = {kind: get("rollstream_scheduler_events_total", {**s, "kind": kind})
              for kind in ("open", "register", "handover", "finish", "publish")}
    assert events == {"open": 1, "register": 1, "handover": 1, "finish": 8, "publish": None}
    assert get("rollstream_samples_finished_total", {**s, "status": "completed"}) == 8
    done = {**s, "status": "completed"}
    assert get("rollstream_session_duration_seconds_count", done) == 8
    assert get("rollstream_session_duration_seconds_sum", done) == 8.0
    assert get("rollstream_session_duration_seconds_bucket", {**done, "le": "1.0"}) == 8
    assert get("rollstream_trained_session_seconds_count", s) == 8  # both groups packed
    assert get("rollstream_trained_session_seconds_sum", s) == 8.0
    assert get("rollstream_samples_submitted_total", s) == 8
    assert get("rollstream_groups_admitted_total", s) == 2
    assert get("rollstream_samples_in_flight", s) == adm.sched.in_flight == 0
