"""`PromptSetSource`: single-turn RLVR over a prompt set (`domain.envs.PromptSet`), sampled by
`PolicySource`.

    source = PromptSetSource(prompts="train.jsonl", max_new_tokens=6)   # {"prompt", "answer"} lines
    source = PromptSetSource(prompts=[{"prompt": "3+4=", "answer": "7"}, ...])

Task `i` (`task_ids` row i) is prompt `i mod len(prompts)`; a task whose payload carries
`prompt` and `answer` is that problem instead. One completion per session: the prompt is
`<bos>` and the encoded prompt text (`domain.envs.VOCAB`), or with `tokenizer=DIR` (a local Hugging
Face tokenizer; `PromptSetSource` takes the model directory's own when `model_config` is one
that holds a tokenizer) the tokenizer's chat template for a user turn, or its bos and the
text when it has no template; the completion ends at eos, and the verifier scores the text
before it against the answer: `exact` (1 or 0) or `partial` (the share of characters right
in place, `domain.envs.score`), or any `verifier(answer, said) -> [0, 1]`.
A completion cut at `max_new_tokens` is TRUNCATED and still scored (for `truncation="score"`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from consumers.sources.policy import PolicySource
from domain.envs import PromptSet


class PromptSetSource(PolicySource):
    """`PolicySource` over a `PromptSet`: one completion per session (`max_turns=1`)."""

    def __init__(self, *, prompts: Any, verifier: str | Callable[[str, str], float] = "exact",
                 tokenizer: str | os.PathLike[str] | None = None, **policy: Any) -> None:
        from domain.tokenizers import has_tokenizer

        policy.setdefault("max_turns", 1)
        model = policy.get("model_config")
        if tokenizer is None and isinstance(model, (str, os.PathLike)) and has_tokenizer(model):
            tokenizer = model  # a Hugging Face model directory speaks its own tokenizer
        super().__init__(env=PromptSet(prompts, verifier=verifier, tokenizer=tokenizer), **policy)
