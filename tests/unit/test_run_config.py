"""`RunConfig` (`rollstream trainer --config`): a bad file fails at start with the field
named; the task stream is a pure function of the step (the checkpointed data position)."""

import itertools

import pytest

from pipeline.config import ConfigError, build
from trainer.config import RunConfig
from trainer.main import batches


@pytest.mark.parametrize("data, field", [
    ({"data": {"env": "chess"}}, "data"),
    ({"publisher": {"kind": "directory"}}, "publisher"),
    ({"checkpoint": {"resume": "require"}}, "checkpoint.resume"),
    ({"checkpoint": {"every": -1}}, "checkpoint.every"),
    ({"steps": 0}, "steps"),
    ({"share": 0}, "share"),
    ({"scheduler": {"groups": "8"}}, "scheduler.groups"),
    ({"trainer": {"zero_stage": 3}}, "trainer.zero_stage"),
    ({"objective": {"eps_low": 1.5}}, "objective.eps_low"),
    ({"steps": 3, "stpes": 4}, "stpes"),
])
def test_a_bad_run_config_names_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        build(RunConfig, data)


def test_defaults_are_a_valid_run():
    config = build(RunConfig, {})
    assert config.checkpoint.dir is None and config.share == 1 and config.publisher.kind == "redis"


def test_batches_are_disjoint_across_shares_and_steps_and_restart_at_any_step():
    data = build(RunConfig, {"data": {"batch_size": 3, "first_task": 10}}).data
    shares = [list(itertools.islice(batches(data, s, 2), 4)) for s in (0, 1)]
    ids = [t for share in shares for batch in share for t in batch["task_id"]]
    assert sorted(ids) == list(range(10, 10 + 2 * 4 * 3))
    assert shares[0][0]["task_id"] == [10, 11, 12] and shares[1][0]["task_id"] == [13, 14, 15]
    assert next(batches(data, 1, 2, start=2)) == shares[1][2]  # resuming at step 2


def test_a_yaml_file_reads_exponent_floats_as_numbers(tmp_path):
    from pipeline.config import load

    path = tmp_path / "trainer.yaml"
    path.write_text("trainer:\n  optimizer: {lr: 1e-06}\nobjective: {importance_cap: 2E+0}\n")
    config = load(RunConfig, path)
    assert config.trainer.optimizer.lr == 1e-06 and config.objective.importance_cap == 2.0
