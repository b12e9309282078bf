"""`HarnessSource` session by session (real engine and gateway servers): a subprocess
harness, the turn, context and wall-clock limits, cancellation, crashes, an unreachable
gateway, a wrong engine set-up; and the engine following new weight versions from a run's
Redis weights stream and from a directory."""

import sys
import textwrap
import threading
import time

import httpx
import openai
import pytest
import torch

from consumers.cpu_engine import DirectoryFollower, Engine, RedisFollower
from consumers.http import ServerThread
from domain.envs import VOCAB
from consumers.sources.harness import HarnessSource
from pipeline.sessions import SessionRequest, Status, Task
from producers.publishers import DirectoryPublisher, RedisPublisher
from producers.trainer_link import TaskWriter
from tests.integration.harness_stack import GuessHarness, Stack, verify
from domain.model import TinyConfig, TinyTransformer

pytestmark = pytest.mark.timeout(60)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=32)


def request(task="1", secret=3, cancelled=None, deadline=None, attempt=0):
    return SessionRequest(Task(task, {"secret": secret}), group=0, sample=0, attempt=attempt,
                          submitted_version=0, deadline=deadline, cancelled=cancelled or threading.Event(),
                          served_version=lambda: 0)


@pytest.fixture(scope="module")
def stack():
    s = Stack(TinyTransformer(CONFIG))
    yield s
    s.close()


def source(stack, harness, **kw):
    return HarnessSource(gateway=stack.url, harness=harness, verifier=kw.pop("verifier", verify), **kw)


AGENT = textwrap.dedent("""
    import json, os, sys
    from openai import OpenAI
    client = OpenAI(max_retries=0)          # OPENAI_BASE_URL and OPENAI_API_KEY from the source
    task = json.loads(os.environ["ROLLSTREAM_TASK"])
    messages = [{"role": "user", "content": "<guess>"}]
    for turn in range(2):
        said = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices[0].message.content
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "<lower>"}]
    if os.environ["ROLLSTREAM_TASK_ID"] == "crash":
        sys.exit("the agent crashed")
    print(json.dumps({"solved": True, "turn": 1, "secret": task["secret"]}))
""")


def test_a_subprocess_harness_is_recorded_and_scored_on_its_stdout(stack, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    import json

    seen = []

    def verifier(task, output):
        seen.append(output)
        return None if output is None else (json.loads(output)["secret"] / 10, {"turn": 1.0})

    src = source(stack, [sys.executable, str(script)], verifier=verifier)
    s = src.run(request(secret=7))
    assert s.status is Status.COMPLETED and s.reward == pytest.approx(0.7) and s.components == {"turn": 1.0}
    assert len(s.calls) == 2 and all(c.version == 0 for c in s.calls)
    assert s.calls[0].prompt_ids.tolist() == [VOCAB.bos, VOCAB["<guess>"]]
    # a non-zero exit is the agent's failure: scored on no output (None counts as 0)
    s = src.run(request("crash"))
    assert s.status is Status.AGENT_ERROR and s.reward == 0.0 and len(s.calls) == 2 and seen[-1] is None
    assert stack.gateway.sessions == {}  # every session freed


def test_the_turn_limit_truncates_and_a_harness_that_returns_is_still_scored(stack):
    def stubborn(ctx):
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        for _ in range(5):
            try:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "<guess>"}],
                                               max_tokens=1)
            except openai.BadRequestError as exc:
                return {"solved": True, "turn": 0, "stopped": exc.code}
        return None

    s = source(stack, stubborn, max_turns=2).run(request())
    assert s.status is Status.TRUNCATED and s.truncation == "max_turns" and len(s.calls) == 2
    assert s.reward == 1.0  # the harness returned: its verifier ran
    s = source(stack, GuessHarness(max_tokens=4), max_tokens=5).run(request(secret=99))
    assert s.status is Status.TRUNCATED and s.truncation == "max_tokens"


def test_wall_clock_and_cancel_stop_a_session_at_once(stack, tmp_path):
    def slow(ctx):
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "<guess>"}], max_tokens=1)
        time.sleep(3)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "<guess>"}], max_tokens=1)

    start = time.monotonic()
    s = source(stack, slow, timeout_s=0.5).run(request())
    assert s.status is Status.TRUNCATED and s.truncation == "wall_clock" and s.reward is None
    assert len(s.calls) == 1 and time.monotonic() - start < 2.5
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(30)\n")
    start = time.monotonic()
    s = source(stack, [sys.executable, str(sleeper)]).run(request(cancelled=cancelled))
    assert s.status is Status.CANCELLED and time.monotonic() - start < 5
    # the request's own deadline is a wall-clock limit too
    s = source(stack, slow).run(request(deadline=time.time() + 0.3))
    assert s.status is Status.TRUNCATED and s.truncation == "wall_clock"


def test_an_unreachable_gateway_is_infra_and_an_engine_without_token_ids_raises(stack):
    with ServerThread(__import__("aiohttp").web.Application(), name="gone") as gone:
        url = gone.url
    s = HarnessSource(gateway=url, harness=GuessHarness(), verifier=verify).run(request())
    assert s.status is Status.INFRA_ERROR and s.reward is None
    with pytest.raises(ValueError, match="gateway"):
        HarnessSource(gateway="localhost:8000", harness=GuessHarness(), verifier=verify)
    with pytest.raises(TypeError, match="harness"):
        HarnessSource(gateway=stack.url, harness=42, verifier=verify)
    with pytest.raises(ValueError, match="max_turns"):
        HarnessSource(gateway=stack.url, harness=GuessHarness(), verifier=verify, max_turns=0)
    # a verifier named module:function (the form a consumer's JSON config carries)
    src = HarnessSource(gateway=stack.url, harness=GuessHarness(),
                        verifier="tests.integration.harness_stack:verify")
    assert src.run(request()).status is Status.COMPLETED

    def completed_without_reward(task, output):
        return None

    with pytest.raises(ValueError, match="verifier returned None"):
        source(stack, GuessHarness(), verifier=completed_without_reward).run(request())


def test_the_engine_follows_the_runs_weights_stream_and_a_directory(r, keys, redis_config, tmp_path):
    engine = Engine(TinyTransformer(CONFIG))
    follower = RedisFollower(engine, redis_config, block_ms=50)
    writer, publisher = TaskWriter(r, keys, 0), RedisPublisher(r, keys)
    try:
        for version in (1, 2):
            model = TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": version}))
            at = publisher.load(model, version)
            writer.announce_weights(version, location=at.location, digest=at.digest, size=at.size)
            deadline = time.monotonic() + 10
            while engine.version != version:
                assert time.monotonic() < deadline and follower.failure is None, follower.failure
                time.sleep(0.02)
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in model.state_dict().items())
    finally:
        follower.stop()
    # a follower started later loads the newest announced version at once
    late = Engine(TinyTransformer(CONFIG))
    follower = RedisFollower(late, redis_config, block_ms=50)
    try:
        deadline = time.monotonic() + 10
        while late.version != 2:
            assert time.monotonic() < deadline, "the newest version was not loaded"
            time.sleep(0.02)
    finally:
        follower.stop()
    watcher = DirectoryFollower(engine, tmp_path, poll_s=0.02)
    try:
        DirectoryPublisher(tmp_path).load(TinyTransformer(CONFIG), 5)
        deadline = time.monotonic() + 10
        while engine.version != 5:
            assert time.monotonic() < deadline and watcher.failure is None
            time.sleep(0.02)
    finally:
        watcher.stop()
    with httpx.Client() as client:
        with ServerThread(engine.app(), name="engine") as s:
            assert client.get(f"{s.url}/health").json()["weight_version"] == 5


@pytest.mark.slow  # two processes importing torch: about 20 s on two shared cores
def test_rollstream_engine_and_gateway_run_as_processes(tmp_path):
    import os
    import signal
    import subprocess

    from tests.integration.servers import free_port

    def start(*args):
        log = open(tmp_path / f"{args[0]}.log", "wb")  # noqa: SIM115 (closed below)
        return subprocess.Popen([sys.executable, "-m", "rollstream.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT), log

    def wait_up(url, proc, log):
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / log).read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / log).read_text()
            time.sleep(0.2)

    eport, gport = free_port(), free_port()
    started = []
    try:
        started.append(start("engine", "--model", "tiny", "--port", str(eport), "--threads", "1"))
        wait_up(f"http://127.0.0.1:{eport}", started[-1][0], "engine.log")
        started.append(start("gateway", "--engine", f"http://127.0.0.1:{eport}", "--port", str(gport)))
        wait_up(f"http://127.0.0.1:{gport}", started[-1][0], "gateway.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gport}/sessions/cli/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "<guess>"}],
                                                max_tokens=3)
        (call,) = httpx.get(f"http://127.0.0.1:{gport}/sessions/cli").json()["calls"]
        assert call["completion_ids"] == answer.to_dict()["choices"][0]["token_ids"] and call["version"] == 0
    finally:
        for proc, log in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            log.close()
