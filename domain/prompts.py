"""`PromptSetSource`: single-turn RLVR over a prompt set, sampled by `PolicySource`.

    source = PromptSetSource(prompts="train.jsonl", max_new_tokens=6)   # {"prompt", "answer"} lines
    source = PromptSetSource(prompts=[{"prompt": "3+4=", "answer": "7"}, ...])

Task `i` (`task_ids` row i) is prompt `i mod len(prompts)`; a task whose payload carries
`prompt` and `answer` is that problem instead. One completion per session: the prompt is
`<bos>` and the encoded prompt text (`envs.VOCAB`), or with `tokenizer=DIR` (a local Hugging
Face tokenizer; `PromptSetSource` takes the model directory's own when `model_config` is one
that holds a tokenizer) the tokenizer's chat template for a user turn, or its bos and the
text when it has no template; the completion ends at eos, and the verifier scores the text
before it against the answer: `exact` (1 or 0) or `partial` (the share of characters right
in place, `envs.score`), or any `verifier(answer, said) -> [0, 1]`.
A completion cut at `max_new_tokens` is TRUNCATED and still scored (for `truncation="score"`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from consumers.sources.envs import VOCAB, AnswerEpisode, Episode, Vocab, _EnvBase, score
from consumers.sources.policy import PolicySource
from pipeline.sessions import Task


def exact(answer: str, said: str) -> float:
    return float(said.strip() == answer.strip())


VERIFIERS: Mapping[str, Callable[[str, str], float]] = {"exact": exact, "partial": score}


def read_prompts(prompts: str | os.PathLike[str] | Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The problems of a JSONL file (one `{"prompt": ..., "answer": ...}` per line) or a list."""
    if isinstance(prompts, (str, os.PathLike)):
        lines = Path(prompts).read_text().splitlines()
        prompts = [json.loads(line) for line in lines if line.strip()]
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, Mapping) or "prompt" not in p or "answer" not in p:
            raise ValueError(f"prompt {i} needs 'prompt' and 'answer', got {p!r}")
        out.append({"prompt": str(p["prompt"]), "answer": str(p["answer"])})
    if not out:
        raise ValueError("the prompt set is empty")
    return out


class PromptSet(_EnvBase):
    """A single-turn environment over a prompt set (module docstring)."""

    def __init__(self, prompts: Any, *, verifier: str | Callable[[str, str], float] = "exact",
                 vocab: Vocab = VOCAB, tokenizer: str | os.PathLike[str] | None = None) -> None:
        self.prompts = read_prompts(prompts)
        if isinstance(verifier, str) and verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} or a callable, got {verifier!r}")
        self.verifier = VERIFIERS[verifier] if isinstance(verifier, str) else verifier
        if tokenizer is not None:
            from consumers.tokenizers import HFTokenizer

            vocab = HFTokenizer(tokenizer)
        self.vocab = vocab
        for p in self.prompts:  # refuse text the vocabulary cannot encode, up front
            vocab.encode(p["prompt"])

    def problem(self, task: Task) -> dict[str, Any]:
        if "prompt" in task.payload and "answer" in task.payload:
            return {"prompt": str(task.payload["prompt"]), "answer": str(task.payload["answer"])}
        try:
            index = int(task.id)
        except ValueError:
            raise ValueError(f"task {task.id!r}: a prompt-set task id is a row number, or its "
                             "payload carries prompt and answer") from None
        return self.prompts[index % len(self.prompts)]

    def start(self, task: Task) -> Episode:
        p = self.problem(task)
        return AnswerEpisode(self.vocab, self.vocab.prompt(p["prompt"]), p["answer"], self.verifier)


class PromptSetSource(PolicySource):
    """`PolicySource` over a `PromptSet`: one completion per session (`max_turns=1`)."""

    def __init__(self, *, prompts: Any, verifier: str | Callable[[str, str], float] = "exact",
                 tokenizer: str | os.PathLike[str] | None = None, **policy: Any) -> None:
        from consumers.tokenizers import has_tokenizer

        policy.setdefault("max_turns", 1)
        model = policy.get("model_config")
        if tokenizer is None and isinstance(model, (str, os.PathLike)) and has_tokenizer(model):
            tokenizer = model  # a Hugging Face model directory speaks its own tokenizer
        super().__init__(env=PromptSet(prompts, verifier=verifier, tokenizer=tokenizer), **policy)
