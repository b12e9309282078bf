"""The Dockerfile, read without building it (no Docker engine here), against what the Helm
chart runs in its image (`rollstream.chart_run.image_problems`): the image's ENTRYPOINT is the
`rollstream` program the chart's containers run with their arguments, its USER is the
chart's, no path the chart mounts hides what the image installed, and every path the
containers are given is under a mount or in the image's layout."""

from __future__ import annotations

import copy

import pytest

from rollstream import chart_run
from rollstream.chart_run import DOCKERFILE, console_script, image_problems, read_dockerfile
from tests.unit.test_helm import ONE_RANK_CLAIM, PROD, ROLES, SHARED, merged


def test_the_image_layout():
    image = read_dockerfile()
    assert image.entrypoint == ("rollstream",) and image.cmd == ("--help",)
    assert console_script("rollstream") == "rollstream.cli:main"  # what pip installs into the venv's bin/
    assert image.env["PATH"].split(":")[0] == "/opt/venv/bin" and "/opt/venv" in image.dirs
    assert image.user == "10001:10001" and image.workdir == "/home/rollstream"
    assert image.env["PYTHONDONTWRITEBYTECODE"] == "1"  # the chart's root filesystem is read-only


@pytest.mark.parametrize("values", [{}, PROD, SHARED, merged(PROD, ROLES), ONE_RANK_CLAIM],
                         ids=["default", "production", "shares", "roles", "one-rank-claim"])
def test_the_chart_runs_what_the_image_holds(values):
    docs, _ = chart_run.render(values)
    assert image_problems(docs, read_dockerfile()) == []


def _dockerfile(tmp_path, old: str, new: str):
    text = DOCKERFILE.read_text()
    assert old in text
    path = tmp_path / "Dockerfile"
    path.write_text(text.replace(old, new))
    return read_dockerfile(path)


def test_an_image_that_does_not_run_the_charts_command(tmp_path):
    docs, _ = chart_run.render({})
    python = _dockerfile(tmp_path, 'ENTRYPOINT ["rollstream"]', 'ENTRYPOINT ["python", "-m", "rollstream.cli"]')
    assert image_problems(docs, python)[0] == (
        "Dockerfile: ENTRYPOINT is ['python', '-m', 'rollstream.cli'], not the rollstream program")
    other_user = _dockerfile(tmp_path, "USER 10001:10001", "USER 1000:1000")
    assert ("StatefulSet/rs-rollstream-trainer container trainer: securityContext.runAsUser: 10001 is not the "
            "image's USER 1000:1000") in image_problems(docs, other_user)
    no_venv = _dockerfile(tmp_path, "PATH=/opt/venv/bin:${PATH}", "PATH=${PATH}")
    assert "is on the image's PATH" in image_problems(docs, no_venv)[0]


def _edit(docs, kind, name):
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values, edit, expected", [
    ({"trainer": {"persistence": {"enabled": True, "mountPath": "/opt/venv"}}}, None,
     "StatefulSet/rs-rollstream-trainer container trainer: volumeMounts[checkpoints].mountPath: /opt/venv hides the "
     "image's /opt/venv"),
    ({}, lambda docs: _edit(docs, "Deployment", "rs-rollstream-consumer")["args"].__setitem__(2, "/config/c.json"),
     "Deployment/rs-rollstream-consumer container consumer: args[2]: /config/c.json is under no mount and not in "
     "the image"),
    ({}, lambda docs: _edit(docs, "Deployment", "rs-rollstream-consumer")["args"].__setitem__(0, "consume"),
     "Deployment/rs-rollstream-consumer container consumer: args: `rollstream consume --config"),
    ({}, lambda docs: _edit(docs, "StatefulSet", "rs-rollstream-trainer")["env"].append(
        {"name": "HOME", "value": "/etc/rollstream"}),
     "StatefulSet/rs-rollstream-trainer container trainer: env[HOME]: /etc/rollstream is not under a writable mount"),
], ids=["mount-hides-the-venv", "config-not-mounted", "unknown-subcommand", "home-read-only"])
def test_what_the_image_cannot_give_is_named(values, edit, expected):
    docs, _ = chart_run.render(copy.deepcopy(values))
    if edit is not None:
        edit(docs)
    problems = image_problems(docs, read_dockerfile())
    assert any(expected in p for p in problems), problems
