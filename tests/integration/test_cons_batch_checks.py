"""The results of one read are checked together (`wire.results_fields`): one session of the
read with a value the checks refuse fails its attempt with a dead letter giving its own
reason, and every other session of the read is committed as usual."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.sources.sleep import SleepSource
from pipeline import wire
from pipeline.sessions import Status
from tests.integration.test_inline_sessions import _fill, _results

BAD = {  # a change to the completion of group 1, sample 2, and the reason it is refused
    "a NaN log-prob": (lambda call: call.logprobs.__setitem__(3, np.nan),
                       "chains.logprobs: must be finite and <= 0"),
    "a -inf log-prob": (lambda call: call.logprobs.__setitem__(0, -np.inf),
                        "chains.logprobs: must be finite and <= 0"),
    "a token past the vocabulary": (lambda call: call.completion_ids.__setitem__(1, 64),
                                    "chains.tokens: token id 64 is beyond the vocabulary of 64 (the config's vocab)"),
    "a negative token": (lambda call: call.prompt_ids.__setitem__(2, -5),
                         "chains.tokens: token ids must be >= 0, got -5"),
}


class OneBad(SleepSource):
    """Valid sessions, but for group 1, sample 2, whose call it changes after making it."""

    change = staticmethod(lambda call: None)

    def run(self, request):
        session = super().run(request)
        if (request.group, request.sample) == (1, 2):
            self.change(session.calls[0])
        return session


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(BAD))
def test_one_bad_session_of_a_read_is_dead_lettered_and_the_others_commit(threads, r, keys, name):
    change, reason = BAD[name]
    source = OneBad(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0)
    source.change = change
    _fill(r, keys, 16)  # before the consumer starts: one read of 16
    consumer = threads.consumer(source, slots=16, block_ms=20, vocab=64)
    results = _results(r, keys, 16)
    by_sample = {(res.group, res.sample): res for res in results}
    assert len(results) == 16 == len(by_sample)
    bad = by_sample.pop((1, 2))
    assert bad.status is Status.INFRA_ERROR and bad.error is None and not bad.chains
    assert all(res.status is Status.COMPLETED and len(res.chains) == 1 and len(res.chains[0]) == 16
               for res in by_sample.values())
    [(_, dead)] = r.xrange(keys.dead)
    assert dead[b"reason"].decode() == f"invalid session from OneBad for 0:1:2:0: {reason}"
    assert consumer.stats["invalid_sessions"] == 1
    assert all(wire.from_fields(f, wire.Result) for _, f in r.xrange(keys.results(0)))
