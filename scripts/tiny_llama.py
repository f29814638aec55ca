"""Build a tiny Llama checkpoint with a locally trained BPE tokenizer.

Nothing is downloaded: the weights are random (seeded) and the tokenizer is
trained on a small built-in corpus, so the demo and the tests run offline.

    python -m scripts.tiny_llama OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "vLLM serves large language models with paged attention.",
    "AMD Instinct GPUs run AITER kernels for attention and mixture of experts.",
    "Two-batch overlap hides communication behind computation.",
    "A tool call names a function and passes its arguments as JSON.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Once upon a time there was a small model that answered every question.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


def build_tokenizer(out_dir: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    max_positions: int = 1024,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama (GQA, head size 64 by default) to `out_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    return save_random_model(
        LlamaForCausalLM,
        LlamaConfig,
        out_dir,
        seed=seed,
        kind="llama",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        **window,
    )


def save_random_model(
    model_cls,
    config_cls,
    out_dir: str | Path,
    *,
    seed: int,
    kind: str,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    **config,
) -> Path:
    """`model_cls(config_cls(**config))` with seeded random weights, saved to `out_dir`
    beside the local tokenizer, whose vocabulary and special tokens the config takes.
    The MLP is twice `hidden_size` wide and positions go to 1024 unless `config` says."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=512)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        **{"intermediate_size": hidden_size * 2, "max_position_embeddings": 1024, **config},
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # larger weights than the init make greedy outputs varied
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    (out / "atom_tiny_model.json").write_text(json.dumps({"seed": seed, "kind": kind}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the checkpoint and tokenizer to")
    args = parser.parse_args(argv)
    path = build_tiny_llama(args.out_dir)
    print(f"tiny Llama written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
