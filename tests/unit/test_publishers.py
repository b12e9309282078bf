"""Weight publishers and the consumer-side loader: round trips through Redis chunks and a
directory, digest verification, pruning of old versions."""

import pytest
import torch

from consumers.weights import (
    DirectoryWeights,
    RedisWeights,
    WeightsCorrupt,
    WeightsLoader,
    WeightsMissing,
    load_weights,
    weights_loader,
)
from producers.publishers import DirectoryPublisher, Published, RedisPublisher
from domain.model import TinyConfig, TinyTransformer

CONFIG = TinyConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, max_positions=32)


def model(seed=0):
    return TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": seed}))


def assert_same(state, module):
    expected = module.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_redis_round_trip_in_small_chunks(r, keys):
    pub = RedisPublisher(r, keys, chunk_bytes=1000)
    m = model()
    published = pub.load(m, 3)
    assert isinstance(published, Published)
    assert published.location == f"redis:{keys.weights_blob(3)}"
    manifest = r.hgetall(keys.weights_blob(3))
    assert int(manifest[b"chunks"]) == -(-published.size // 1000) > 1
    assert manifest[b"digest"].decode() == published.digest
    assert b"embed.weight" in manifest[b"dtypes"]
    assert_same(WeightsLoader(RedisWeights(r, keys)).load(3), m)
    assert_same(load_weights(published.location, redis=r), m)


def test_a_state_dict_publishes_too_and_a_version_published_again_is_replaced(r, keys):
    pub = RedisPublisher(r, keys, chunk_bytes=500)
    pub.load(model(0), 1)
    pub.load(model(1).state_dict(), 1)
    assert_same(WeightsLoader(RedisWeights(r, keys)).load(1), model(1))


def test_a_corrupted_chunk_fails_the_digest_check_naming_the_version(r, keys):
    RedisPublisher(r, keys, chunk_bytes=1000).load(model(), 7)
    chunk = f"{keys.weights_blob(7)}:1"
    data = bytearray(r.get(chunk))
    data[10] ^= 0xFF
    r.set(chunk, bytes(data))
    with pytest.raises(WeightsCorrupt, match=r"weights version 7 .* corrupt: sha256"):
        WeightsLoader(RedisWeights(r, keys)).load(7)


def test_versions_older_than_the_newest_keep_are_pruned(r, keys):
    pub = RedisPublisher(r, keys, chunk_bytes=4000, keep=2, grace_s=0)
    for version in range(1, 5):
        pub.load(model(version), version)
    loader = WeightsLoader(RedisWeights(r, keys))
    for gone in (1, 2):
        with pytest.raises(WeightsMissing, match=f"weights version {gone} is not stored"):
            loader.load(gone)
    assert not list(r.scan_iter(match=keys.weights_blob(1) + "*"))
    assert_same(loader.load(3), model(3))
    assert_same(loader.load(4), model(4))


def test_superseded_versions_expire_after_a_grace_and_a_new_publisher_finds_them(r, keys):
    RedisPublisher(r, keys, chunk_bytes=4000).load(model(1), 1)
    RedisPublisher(r, keys, chunk_bytes=4000).load(model(2), 2)
    RedisPublisher(r, keys, chunk_bytes=4000, keep=2, grace_s=30).load(model(3), 3)  # a resumed trainer
    assert 0 < r.pttl(keys.weights_blob(1)) <= 30_000
    assert 0 < r.pttl(keys.weights_blob(1) + ":0") <= 30_000
    assert r.pttl(keys.weights_blob(2)) == -1 and r.pttl(keys.weights_blob(3)) == -1


def test_the_loader_caches_the_last_version(r, keys):
    pub = RedisPublisher(r, keys)
    pub.load(model(1), 1)
    loader = WeightsLoader(RedisWeights(r, keys))
    assert loader.load(1) is loader.load(1)
    assert loader.fetches == 1 and loader.version == 1


def test_directory_round_trip_corruption_and_pruning(tmp_path):
    pub = DirectoryPublisher(tmp_path / "w", keep=2)
    for version in range(1, 4):
        published = pub.load(model(version), version)
    assert published.location == f"file://{tmp_path / 'w' / 'v3.safetensors'}"
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v2.safetensors", "v2.safetensors.sha256", "v3.safetensors", "v3.safetensors.sha256"]
    loader = weights_loader(str(tmp_path / "w"))
    assert_same(loader.load(3), model(3))
    assert_same(load_weights(published.location), model(3))
    with pytest.raises(WeightsMissing, match="weights version 1"):
        loader.load(1)
    data = bytearray((tmp_path / "w" / "v2.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "w" / "v2.safetensors").write_bytes(bytes(data))
    with pytest.raises(WeightsCorrupt, match="weights version 2 .* corrupt"):
        WeightsLoader(DirectoryWeights(tmp_path / "w")).load(2)


def test_tied_weights_are_published_apart():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight

    from safetensors.torch import load

    from producers.publishers import serialise

    data, dtypes = serialise(Tied())
    state = load(data)
    assert torch.equal(state["a.weight"], state["b.weight"]) and dtypes["a.weight"] == "float32"
