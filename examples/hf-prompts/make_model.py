"""Write `model/`: a small GPT-2 with a character-level tokenizer, in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json). Nothing is downloaded: it stands in for a
directory of your own (`save_pretrained`, or a checkpoint from the hub copied locally).

    python3 make_model.py [DIR]
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

CHARS = "0123456789+=: abcdefghijklmnopqrstuvwxyz"


def write(path: str) -> None:
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    config = GPT2Config(vocab_size=len(fast), n_layer=2, n_head=2, n_embd=32, n_positions=32,
                        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    print(f"{path}: GPT-2, {sum(p.numel() for p in model.parameters())} parameters, vocabulary of {len(fast)}")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "model")
