import dataclasses
import re

import pytest

from pipeline import keys
from pipeline.keys import ADMISSION_GROUP, TRAINER_GROUP, WORK_GROUP, Keys


def test_names():
    k = Keys("exp-1.a_b")
    assert k.prefix == "rs:{exp-1.a_b}:"
    assert k.tasks(0) == "rs:{exp-1.a_b}:tasks:0"
    assert k.results(3) == "rs:{exp-1.a_b}:results:3"
    assert k.ready(12) == "rs:{exp-1.a_b}:ready:12"
    assert k.records(1) == "rs:{exp-1.a_b}:records:1"
    assert k.state(2) == "rs:{exp-1.a_b}:state:2"
    assert k.work == "rs:{exp-1.a_b}:work"
    assert k.control == "rs:{exp-1.a_b}:control"
    assert k.weights == "rs:{exp-1.a_b}:weights"
    assert k.dead == "rs:{exp-1.a_b}:dead"
    assert k.served_version == "rs:{exp-1.a_b}:served_version"
    assert k.weights_blob(7) == "rs:{exp-1.a_b}:weights:7:blob"
    assert k.consumer_heartbeat("pod-3") == "rs:{exp-1.a_b}:consumer:pod-3:heartbeat"
    assert k.pattern == "rs:{exp-1.a_b}:*"


def test_group_names():
    assert (WORK_GROUP, ADMISSION_GROUP, TRAINER_GROUP) == ("rollout", "admission", "trainer")


def test_all_streams():
    k = Keys("ns")
    streams = k.all_streams(2)
    assert streams == [
        k.work, k.control, k.weights, k.dead,
        k.tasks(0), k.results(0), k.ready(0), k.records(0),
        k.tasks(1), k.results(1), k.ready(1), k.records(1),
    ]
    assert len(set(streams)) == len(streams)
    assert k.all_streams(0) == [k.work, k.control, k.weights, k.dead]
    with pytest.raises(ValueError, match="shards"):
        k.all_streams(-1)


def test_every_key_shares_one_hash_tag_and_matches_the_pattern():
    k = Keys("run7")
    names = k.all_streams(3) + [k.state(0), k.served_version, k.weights_blob(0), k.consumer_heartbeat("c")]
    glob = re.compile(re.escape(k.pattern[:-1]) + ".*")
    for name in names:
        # Redis Cluster hashes the text between the first "{" and the next "}"
        start = name.index("{")
        assert name[start + 1 : name.index("}", start)] == "run7", name
        assert glob.fullmatch(name), name
    assert not glob.fullmatch(Keys("run70").work)


def test_namespaces_do_not_collide():
    assert not set(Keys("a").all_streams(2)) & set(Keys("b").all_streams(2))


@pytest.mark.parametrize("ns", ["", "x" * 65, "a b", "a{b", "a}b", "a*", "a:b", "é", None, 3])
def test_bad_namespace(ns):
    with pytest.raises(ValueError, match="namespace"):
        Keys(ns)


def test_longest_namespace():
    assert Keys("x" * 64).work == "rs:{" + "x" * 64 + "}:work"


@pytest.mark.parametrize("shard", [-1, True, 1.0, "0", None])
def test_bad_shard(shard):
    k = Keys("ns")
    for method in (k.tasks, k.results, k.ready, k.records, k.state):
        with pytest.raises(ValueError, match="shard"):
            method(shard)


def test_bad_version_and_consumer():
    k = Keys("ns")
    with pytest.raises(ValueError, match="version"):
        k.weights_blob(-1)
    with pytest.raises(ValueError, match="consumer"):
        k.consumer_heartbeat("")


def test_frozen_and_comparable():
    k = Keys("ns")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.namespace = "other"
    assert k == Keys("ns") and hash(k) == hash(Keys("ns"))
    assert keys.Keys is Keys
