"""The loss is a global token mean: two DeepSpeed ranks (gloo, CPU) training on a split of a
step's rows take the update one rank takes on all of them (`tests/integration/loss_ranks.py`)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)


def weights(tmp_path, ranks: int) -> dict[str, np.ndarray]:
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", str(ranks), "-m",
                           "tests.integration.loss_ranks", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with np.load(tmp_path / f"weights-{ranks}.npz") as f:
        return dict(f)


def test_two_ranks_on_a_split_of_the_rows_take_one_rank_s_update(tmp_path):
    one, two = weights(tmp_path, 1), weights(tmp_path, 2)
    names = [k.split("/", 1)[1] for k in one if k.startswith("global/")]
    moved = max(float(np.abs(one[f"global/{n}"] - one[f"initial/{n}"]).max()) for n in names)
    assert moved > 1e-3  # the update changed the weights
    for n in names:  # one rank: its token mean is the global one
        np.testing.assert_allclose(one[f"global/{n}"], one[f"local/{n}"], atol=1e-7)
    diff = {n: float(np.abs(two[f"global/{n}"] - one[f"global/{n}"]).max()) for n in names}
    assert max(diff.values()) < 1e-5, diff
    # each rank's own token mean weighs the 14-token row's tokens less: a visible difference
    local = max(float(np.abs(two[f"local/{n}"] - one[f"global/{n}"]).max()) for n in names)
    assert local > 100 * max(max(diff.values()), 1e-7), (local, diff)
