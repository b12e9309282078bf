"""`pipeline.redis_io` against both Redis servers."""

import pytest

from pipeline.streams import ensure_group


@pytest.mark.timeout(30)
def test_ensure_group_creates_the_stream_once_and_reads_from_the_start(r, keys):
    r.xadd(keys.tasks(0), {b"m": b"early"})
    assert ensure_group(r, keys.tasks(0), "g") is True
    assert ensure_group(r, keys.tasks(0), "g") is False  # BUSYGROUP: already there
    assert ensure_group(r, keys.results(0), "g") is True  # MKSTREAM
    assert r.exists(keys.results(0)) == 1
    reply = r.xreadgroup("g", "c", {keys.tasks(0): ">"})
    assert [f for _, entries in reply for _, f in entries] == [{b"m": b"early"}]
