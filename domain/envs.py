"""Tiny environments a `PolicySource` runs, over a character vocabulary (no tokenizer).

`VOCAB` holds `<pad>`, `<bos>`, `<eos>`, a few word tokens (`<guess>`, `<higher>`, `<lower>`,
`<correct>`, `<invalid>`), the digits, `+-*=?:`, space and `a`-`z`: 64 ids, so a
`TinyConfig(vocab=VOCAB.size)` model fits it. `VOCAB.encode("3+4=")` / `VOCAB.decode(ids)`.

An environment turns a `Task` into an `Episode`: its first prompt, then, per policy
completion, a `Turn` (tool output tokens appended to the next prompt, done, reward in [0, 1]
and its components). A task's problem is its payload when the payload carries one, else it
is drawn from a generator seeded by the environment's seed and the task id, so `task_ids`
rows map deterministically to problems; `env.tasks(batch)` gives the tasks with their
problems in the payload (a `RolloutScheduler(tasks=...)`).

- `ArithmeticEnv(op="copy", digits=1)`, single turn: copy or reverse a digit string
  (`"c:3="` -> `"3"` then `<eos>`; `"r:381="` -> `"183"`) or add (`op="add"`: `"3+4="` ->
  `"7"`). The default, one-digit copy, is what a `TinyTransformer(d_model=64, n_layers=2)`
  solves in about 100 s on one CPU thread under plain policy gradient; `add` is harder
  (docs/sources.md).
  Reward: the share of answer characters right in place over the longer of answer and
  completion (1 exactly when right); components `exact`, `eos` (the completion ended).
  A completion cut at the token limit (`Episode.truncated`) is scored the same way on what
  it said, so under a `max_new_tokens` equal to the answer's length (1 for one-digit copy,
  what `rollstream demo --trainer` uses) the right answer earns 1 without `<eos>` and a
  wrong one 0 (the verifier is unchanged: the answer is the whole completion); with a
  longer limit, an answer followed by other tokens instead of `<eos>` earns its share
  (`3xy` -> 1/3).
- `GuessEnv(n=8, max_turns=3)`, multi-turn: the prompt is `<bos><guess>`; each turn the
  policy emits a digit (then `<eos>`) and the environment answers `<higher>`, `<lower>`,
  `<correct>` or `<invalid>`. Each call's prompt is the previous prompt, completion and
  answer, so the calls merge into one chain. Reward on a correct guess at turn t (from 0):
  `1 - t / max_turns`; 0 when the turns run out. Binary search is optimal.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.sessions import Task
from domain.batches import task_ids

_WORDS = ("<pad>", "<bos>", "<eos>", "<guess>", "<higher>", "<lower>", "<correct>", "<invalid>")
_CHARS = "0123456789+-*=?: abcdefghijklmnopqrstuvwxyz"


class Vocab:
    """Word tokens (`<name>`) and single characters; unknown characters are refused."""

    def __init__(self, words: Sequence[str] = _WORDS, chars: str = _CHARS, size: int = 64) -> None:
        self.tokens = [*words, *chars]
        if len(self.tokens) > size:
            raise ValueError(f"{len(self.tokens)} tokens do not fit size {size}")
        self.size = size
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad, self.bos, self.eos = self.ids["<pad>"], self.ids["<bos>"], self.ids["<eos>"]

    def __getitem__(self, token: str) -> int:
        return self.ids[token]

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in re.findall(r"<[a-z]+>|.", text, flags=re.DOTALL):
            if piece not in self.ids:
                raise ValueError(f"{piece!r} is not in the vocabulary")
            out.append(self.ids[piece])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.tokens[i] if 0 <= i < len(self.tokens) else "<unk>" for i in ids)

    def until_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first `<eos>`, and whether there was one."""
        return until(ids, self.eos)

    def prompt(self, text: str) -> list[int]:
        """A single-turn prompt: `<bos>` and the text."""
        return [self.bos, *self.encode(text)]


def until(ids: Sequence[int], eos: int) -> tuple[list[int], bool]:
    """The ids before the first `eos`, and whether there was one."""
    ids = list(ids)
    if eos in ids:
        return ids[:ids.index(eos)], True
    return ids, False


VOCAB = Vocab()


@dataclass
class Turn:
    """What the environment answers to one completion."""

    reply: list[int]
    done: bool
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)


class Episode(Protocol):
    prompt: list[int]

    def step(self, completion: Sequence[int]) -> Turn: ...

    def truncated(self, completion: Sequence[int]) -> float | None:
        """The reward of an episode cut at the token limit mid-completion (None: unscored)."""
        ...


class Env(Protocol):
    vocab: Vocab

    def start(self, task: Task) -> Episode: ...


def task_rng(seed: int, task_id: str) -> random.Random:
    """A generator determined by `seed` and the task id (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def score(answer: str, said: str) -> float:
    """The share of characters of `said` right in place, over the longer of the two."""
    longest = max(len(answer), len(said))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, said)) / longest


class EnvBase:
    """What every environment here shares: `tasks(batch)` gives each task its problem."""

    vocab: Vocab = VOCAB
    seed: int = 0

    def problem(self, task: Task) -> dict[str, Any]:
        raise NotImplementedError

    def tasks(self, batch: Any) -> list[Task]:
        """`task_ids(batch)` with each task's problem in its payload."""
        return [Task(t.id, self.problem(t)) for t in task_ids(batch)]


# ----------------------------------------------------------------------------- single turn


class ArithmeticEnv(EnvBase):
    """Single turn: `op` in copy | reverse | add (module docstring). `digits` is the length
    of copy/reverse; `max_operand` bounds the addends of `add` (default 4: one-digit sums)."""

    def __init__(self, *, op: str = "copy", digits: int = 1, max_operand: int = 4, seed: int = 0) -> None:
        if op not in ("add", "copy", "reverse"):
            raise ValueError(f"op must be add, copy or reverse, got {op!r}")
        if max_operand < 0 or digits < 1:
            raise ValueError("need max_operand >= 0 and digits >= 1")
        self.op, self.max_operand, self.digits, self.seed = op, max_operand, digits, seed

    def problem(self, task: Task) -> dict[str, Any]:
        if "prompt" in task.payload and "answer" in task.payload:
            return dict(task.payload)
        rng = task_rng(self.seed, task.id)
        if self.op == "add":
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        s = "".join(rng.choice("0123456789") for _ in range(self.digits))
        if self.op == "copy":
            return {"prompt": f"c:{s}=", "answer": s}
        return {"prompt": f"r:{s}=", "answer": s[::-1]}

    def start(self, task: Task) -> Episode:
        p = self.problem(task)
        return AnswerEpisode(self.vocab, [self.vocab.bos, *self.vocab.encode(str(p["prompt"]))], str(p["answer"]))


class AnswerEpisode:
    """One prompt, one completion scored against `answer` by `verifier(answer, said)`."""

    def __init__(self, vocab: Vocab, prompt: list[int], answer: str, verifier: Any = score) -> None:
        self.vocab, self.prompt, self.answer, self.verifier = vocab, prompt, answer, verifier

    def _reward(self, completion: Sequence[int]) -> tuple[float, dict[str, float]]:
        ids, ended = self.vocab.until_eos(completion)
        said = self.vocab.decode(ids)
        reward = float(self.verifier(self.answer, said))
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"the verifier returned {reward}, outside [0, 1]")
        return reward, {"exact": float(said == self.answer), "eos": float(ended)}

    def step(self, completion: Sequence[int]) -> Turn:
        reward, components = self._reward(completion)
        return Turn([], True, reward, components)

    def truncated(self, completion: Sequence[int]) -> float | None:
        return self._reward(completion)[0]


# ----------------------------------------------------------------------------- multi turn


class GuessEnv(EnvBase):
    """Guess a secret in [0, n) in `max_turns` turns, told higher or lower (module docstring)."""

    def __init__(self, *, n: int = 8, max_turns: int = 3, seed: int = 0) -> None:
        if not 1 <= n <= 10 or max_turns < 1:
            raise ValueError(f"need 1 <= n <= 10 and max_turns >= 1, got {n}, {max_turns}")
        self.n, self.max_turns, self.seed = n, max_turns, seed

    def problem(self, task: Task) -> dict[str, Any]:
        if "secret" in task.payload:
            return {"secret": int(task.payload["secret"])}
        return {"secret": task_rng(self.seed, task.id).randrange(self.n)}

    def start(self, task: Task) -> Episode:
        secret = self.problem(task)["secret"]
        if not 0 <= secret < self.n:
            raise ValueError(f"secret {secret} is outside [0, {self.n})")
        return GuessEpisode(self.vocab, secret, self.max_turns)


class GuessEpisode:
    def __init__(self, vocab: Vocab, secret: int, max_turns: int) -> None:
        self.vocab, self.secret, self.max_turns = vocab, secret, max_turns
        self.prompt = [vocab.bos, vocab["<guess>"]]
        self.turn = 0

    def step(self, completion: Sequence[int]) -> Turn:
        ids, _ = self.vocab.until_eos(completion)
        said = self.vocab.decode(ids)
        turn, self.turn = self.turn, self.turn + 1
        last = self.turn >= self.max_turns
        if not said.isdigit():
            return Turn([self.vocab["<invalid>"]], last, 0.0 if last else None, self._parts(0.0, turn) if last else {})
        guess = int(said)
        if guess == self.secret:
            reward = 1.0 - turn / self.max_turns
            return Turn([self.vocab["<correct>"]], True, reward, self._parts(1.0, turn))
        reply = "<higher>" if self.secret > guess else "<lower>"
        return Turn([self.vocab[reply]], last, 0.0 if last else None, self._parts(0.0, turn) if last else {})

    def _parts(self, solved: float, turn: int) -> dict[str, float]:
        return {"solved": solved, "turns": float(turn + 1)}

    def truncated(self, completion: Sequence[int]) -> float | None:
        return None


# ----------------------------------------------------------------------------- prompt sets
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


class PromptSet(EnvBase):
    """A single-turn environment over a prompt set (module docstring)."""

    def __init__(self, prompts: Any, *, verifier: str | Callable[[str, str], float] = "exact",
                 vocab: Vocab = VOCAB, tokenizer: str | os.PathLike[str] | None = None) -> None:
        self.prompts = read_prompts(prompts)
        if isinstance(verifier, str) and verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} or a callable, got {verifier!r}")
        self.verifier = VERIFIERS[verifier] if isinstance(verifier, str) else verifier
        if tokenizer is not None:
            from domain.tokenizers import HFTokenizer

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


ENVS: Mapping[str, Callable[..., Any]] = {"arithmetic": ArithmeticEnv, "guess": GuessEnv, "prompts": PromptSet}
"""Environments by name, for a `PolicySource(env="guess", env_args={...})` built from config;
`prompts` is `PromptSet` (`env_args: {prompts: FILE.jsonl,
verifier: exact|partial}`), a prompt set of your own."""


def environment(env: Any, env_args: Mapping[str, Any] | None = None) -> Any:
    """`env` itself, or the environment of `ENVS` it names built with `env_args` (what a
    source built from a consumer config gets: `env: prompts`, `env_args: {...}`)."""
    if isinstance(env, str):
        return ENVS[env](**dict(env_args or {}))
    if env_args:
        raise ValueError("env_args applies to an environment named by a string")
    return env
