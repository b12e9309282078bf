"""`RunConfig` (`rollstream trainer --config`): a bad file fails at start with the field
named; the task stream is a pure function of the step (the checkpointed data position)."""

import itertools
import json

import pytest

from pipeline.config import ConfigError, build
from trainer.run_config import RunConfig
from consumers.sources.policy import PolicySource
from domain.envs import PromptSet
from pipeline.sessions import Status
from trainer.main import batches, data_env


@pytest.mark.parametrize("data, field", [
    ({"data": {"env": "chess"}}, "data"),
    ({"publisher": {"kind": "directory"}}, "publisher"),
    ({"publisher": {"kind": "vllm", "path": "/w"}}, "publisher.*engines"),
    ({"publisher": {"kind": "vllm", "path": "/w", "engines": ["vllm-0:8000"]}}, "publisher.*not an http"),
    ({"publisher": {"kind": "redis", "gateways": ["http://gw:8000"]}}, "publisher.*kind=vllm or sglang"),
    ({"publisher": {"kind": "vllm", "path": "/w", "engines": ["http://v:8000"], "pause_mode": "later"}},
     "publisher.pause_mode"),
    ({"checkpoint": {"resume": "require"}}, "checkpoint.resume"),
    ({"checkpoint": {"every": -1}}, "checkpoint.every"),
    ({"steps": 0}, "steps"),
    ({"share": 0}, "share"),
    ({"scheduler": {"groups": "8"}}, "scheduler.groups"),
    ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage"),
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


def test_a_prompt_file_is_the_data_of_the_trainer_and_of_the_consumers(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [{"prompt": "2+3=", "answer": "5"},
                                                      {"prompt": "c:7=", "answer": "7"}]) + "\n")
    data = build(RunConfig, {"data": {"env": "prompts", "env_args": {"prompts": str(path)},
                                      "batch_size": 3}}).data
    env = data_env(data)
    assert isinstance(env, PromptSet)
    tasks = env.tasks(next(batches(data, 0, 1)))  # task i is row i mod 2, in its payload
    assert [(t.id, t.payload["prompt"]) for t in tasks] == [("0", "2+3="), ("1", "c:7="), ("2", "2+3=")]
    # a consumer's source built from the same section runs those tasks
    from tests.unit.test_policy_sources import CONFIG, request

    source = PolicySource(env=data.env, env_args=data.env_args, model_config=CONFIG,
                          max_new_tokens=2, seed=0)
    session = source.run(request("1"))
    assert session.status in (Status.COMPLETED, Status.TRUNCATED) and len(session.calls) == 1
    assert list(session.calls[0].prompt_ids)[1:] == env.vocab.encode("c:7=")


@pytest.mark.parametrize("env_args, reason", [
    ({"prompts": "/nonexistent/train.jsonl"}, "No such file"),
    ({"prompts": [{"question": "?"}]}, "needs 'prompt' and 'answer'"),
    ({"prompts": [{"prompt": "1", "answer": "1"}], "verifier": "fuzzy"}, "fuzzy"),
    ({"prompt": "x"}, "unexpected keyword"),
])
def test_a_data_section_the_environment_refuses_names_data_env_args(env_args, reason):
    data = build(RunConfig, {"data": {"env": "prompts", "env_args": env_args}}).data
    with pytest.raises(ConfigError, match=f"data.env_args: prompts refused .*{reason}"):
        data_env(data)


def test_an_engine_publisher_is_built_from_the_publisher_section(tmp_path):
    from producers.engine_publishers import SGLangPublisher, VLLMPublisher
    from trainer.main import _publisher

    config = build(RunConfig, {"publisher": {"kind": "sglang", "path": str(tmp_path), "engines": ["http://s:30000"],
                                             "gateways": ["http://gw:8000"], "retries": 1, "keep": 3}})
    publisher = _publisher(config, None, None)
    assert isinstance(publisher, SGLangPublisher) and not isinstance(publisher, VLLMPublisher)
    assert (publisher.engines, publisher.gateways, publisher.retries, publisher.keep) == (
        ["http://s:30000"], ["http://gw:8000"], 1, 3)


def test_the_rollout_scheduler_takes_every_scheduler_field_the_trainer_passes():
    """`rollstream trainer` passes its whole scheduler section (but `timeout_s`, as `timeout`)
    to `RolloutScheduler`: a field it does not take stops every trainer at start."""
    import inspect

    from pipeline.config import SchedulerConfig
    from trainer.rollout_scheduler import RolloutScheduler

    taken = set(inspect.signature(RolloutScheduler.__init__).parameters)
    assert set(SchedulerConfig.model_fields) - {"timeout_s"} <= taken
