"""Text to token ids and back, for `rollstream engine` and the prompt-set environment.

- `CharTokenizer`: the built-in environments' `VOCAB` (characters and `<word>` tokens) over a
  model of any size; ids without a token are written `<tNN>` and read back.
- `HFTokenizer(path)`: a Hugging Face tokenizer read from a local directory (nothing is
  downloaded), with its chat template when it has one. It also speaks the `envs.Vocab`
  interface an episode and `PolicySource` use (`size`, `bos`, `eos`, `encode`, `decode`,
  `until_eos`, `prompt`), so `PromptSet(tokenizer=path)` runs a real model with its own
  tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from domain.envs import VOCAB, Vocab, until

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    """Whether the directory `path` holds a Hugging Face tokenizer."""
    path = Path(path)
    return path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES)


class CharTokenizer:
    """`VOCAB` (characters and `<word>` tokens) over a model of `size` ids; an id without a
    token is written `<tNN>` and read back, so any completion round-trips exactly."""

    def __init__(self, vocab: Vocab = VOCAB, size: int | None = None) -> None:
        self.vocab, self.size = vocab, size or vocab.size
        self.eos, self.bos = vocab.eos, vocab.bos

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in re.findall(r"<[a-z]+>|<t\d+>|.", text, flags=re.DOTALL):
            m = re.fullmatch(r"<t(\d+)>", piece)
            if m and int(m.group(1)) < self.size:
                out.append(int(m.group(1)))
            elif piece in self.vocab.ids:
                out.append(self.vocab.ids[piece])
            else:
                raise ValueError(f"{piece!r} is not in the vocabulary")
        return out

    def decode(self, ids: Sequence[int]) -> str:
        tokens = self.vocab.tokens
        return "".join(tokens[i] if i < len(tokens) else f"<t{i}>" for i in ids)

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        ids = [self.bos]
        for m in messages:
            ids += self.encode(m["content"])
            if m["role"] == "assistant":
                ids.append(self.eos)
        return ids


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory; its chat template when it has one."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        if not has_tokenizer(path):
            raise ValueError(f"no tokenizer at {path} (none of {', '.join(TOKENIZER_FILES)})")
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tok.eos_token_id is None:
            raise ValueError(f"the tokenizer at {path} has no eos token")
        self.eos = int(self.tok.eos_token_id)
        self.bos = None if self.tok.bos_token_id is None else int(self.tok.bos_token_id)
        self.size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            # return_dict=False: transformers 5 otherwise returns a BatchEncoding (its keys would be listed)
            return list(self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        return self.encode("".join(m["content"] for m in messages))

    def until_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first eos, and whether there was one."""
        return until(ids, self.eos)

    def prompt(self, text: str) -> list[int]:
        """A single-turn prompt: the chat template's user turn when the tokenizer has one,
        otherwise bos (when it has one) and the text."""
        if getattr(self.tok, "chat_template", None):
            return self.chat([{"role": "user", "content": text}])
        return ([] if self.bos is None else [self.bos]) + self.encode(text)
