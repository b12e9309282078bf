"""A small Hugging Face model directory built locally: a BPE tokenizer trained with the
`tokenizers` library (chat template, eos) and a causal LM built from a config, saved with
`save_pretrained`. The same directory serves the trainer (`model: {kind: hf, path: DIR}`),
an inference engine (vLLM, `rollstream engine --model DIR`) and the prompt set's tokenizer,
with nothing downloaded.

    write_model_dir("runs/tiny-qwen")                   # Qwen2ForCausalLM, 0.33 M parameters
    write_model_dir(path, arch="llama", hidden=256, layers=4)

The tokenizer speaks ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`, eos `<|im_end|>`,
pad `<|endoftext|>`), trained on `corpus` (by default the text of the built-in arithmetic
tasks and a few words, so digits, `c:`, `=` and the template's role names are single
tokens or short merges). `head_dim` is `hidden / heads`: 32 by default, a size vLLM's CPU
attention supports (32, 64, 80, ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHS = ("qwen2", "llama")


def default_corpus() -> list[str]:
    """Text of the arithmetic tasks (copy, reverse, add) and the chat roles."""
    lines = [f"c:{a}{b}= {a}{b}" for a in range(10) for b in range(10)]
    lines += [f"r:{a}{b}= {b}{a}" for a in range(10) for b in range(10)]
    lines += [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    lines += ["user assistant system", "the quick brown fox jumps over the lazy dog"] * 10
    return lines


def train_tokenizer(path: str | Path, corpus: Iterable[str] | None = None, vocab_size: int = 300) -> Any:
    """Train a byte-level BPE tokenizer on `corpus` and save it (with the chat template)
    to `path`; returns the `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus if corpus is not None else default_corpus()), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def model_config(arch: str, vocab_size: int, eos: int, pad: int, *, hidden: int = 128, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, intermediate: int | None = None,
                 max_positions: int = 1024, tie: bool = True) -> Any:
    """The `transformers` config of a small `arch` (qwen2 or llama) causal LM."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got {hidden}, {heads}, {kv_heads}")
    kind = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    return kind(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate or 2 * hidden,
                max_position_embeddings=max_positions, tie_word_embeddings=tie, eos_token_id=eos,
                pad_token_id=pad, bos_token_id=None, dtype="float32")


def write_model_dir(path: str | Path, *, arch: str = "qwen2", corpus: Iterable[str] | None = None,
                    vocab_size: int = 300, seed: int = 0, **sizes: Any) -> Path:
    """Train the tokenizer, build the model from its config under `seed`, and save both to
    `path` (module docstring); returns `path`. `sizes`: `model_config`'s keywords."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast = train_tokenizer(path, corpus, vocab_size)
    config = model_config(arch, len(fast), fast.eos_token_id, fast.pad_token_id, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    return path
