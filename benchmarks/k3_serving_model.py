"""A Kimi-K3-format model folder for `vllm serve` with random weights (`--load-format dummy`).

The folder holds a `config.json` of one of `SHAPES` and a synthetic K3 tokenizer saved as
a Hugging Face fast tokenizer: the pieces of `benchmarks.k3_vocab` (K3's vocabulary size
by default, 163,840 ids, the top 256 special with K3's four control tokens among them;
`<|end_of_msg|>` is EOS), greedy longest match within each space-led word (WordPiece
without a continuation prefix), decoded by concatenation. Its chat template writes K3's
prompt: the tools declared by name, each message in its response channel, and the
assistant's turn left open inside `<|open|>response<|sep|>`. Nothing is downloaded.

    python -m benchmarks.k3_serving_model OUT_DIR [--shape deepseek-v3] [--vocab 163840]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.k3_vocab import CONTROL, SyntheticK3Tokenizer

K3_VOCAB = 163_840
UNK = "<|reserved_255|>"  # a special that nothing encodes to (every ASCII text has pieces)

# K3's prompt format; tools are declared by name, so a schema's size does not change the
# prompt's length (the schemas reach the server in the request, and the constraint).
CHAT_TEMPLATE = (
    "{%- if tools %}<|open|>tool_declare<|sep|>"
    "{%- for t in tools %}{{ (t.function or t)['name'] }} {%- endfor %}"
    "<|close|>tool_declare<|sep|>{%- endif %}"
    "{%- for m in messages %}<|open|>message role=\"{{ m['role'] }}\"<|sep|>"
    "<|open|>response<|sep|>{{ m['content'] }}<|close|>response<|sep|>"
    "<|close|>message<|sep|>{%- endfor %}"
    '{%- if add_generation_prompt %}<|open|>message role="assistant"<|sep|>'
    "<|open|>response<|sep|>{%- endif %}"
)

_MLA = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "max_position_embeddings": 4096,
    "rope_scaling": None,
}
SHAPES: dict[str, dict] = {
    # DeepSeek-V3's (and Kimi-K2's) attention: 128 heads, q_lora_rank 1536, latent 512 + 64,
    # nope/v 128; dense MLPs on every layer (first_k_dense_replace = layers): the decode shape
    # of the large model on four layers, which one GPU holds with room for a large batch.
    "deepseek-v3": {
        **_MLA,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 4,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "torch_dtype": "bfloat16",
    },
    # The same architecture at toy size for vLLM's CPU build (its MLA decode needs the
    # 512 + 64 latent).
    "tiny-mla": {
        **_MLA,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "torch_dtype": "float32",
    },
    # A Llama whose CPU step takes long enough (about 10-20 ms) that a stream's chunks
    # arrive one token at a time: the admission benchmark's gaps need that pace.
    "small-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}


def build_tokenizer(out_dir: Path, vocab: int = K3_VOCAB):
    """The synthetic K3 tokenizer of `vocab` ids, saved to `out_dir`; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    synthetic = SyntheticK3Tokenizer(vocab)
    pieces = synthetic.pieces
    model = models.WordPiece(
        {p: i for i, p in enumerate(pieces)},
        unk_token=UNK,
        continuing_subword_prefix="",
        max_input_chars_per_word=1 << 30,
    )
    tokenizer = Tokenizer(model)
    # Words of a leading space and non-space characters (or a run of spaces), so the
    # longest match looks at one word at a time.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^ ]+| +"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    specials = [pieces[i] for i in synthetic.all_special_ids]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        eos_token=CONTROL[3],
        bos_token=CONTROL[3],
        additional_special_tokens=[t for t in specials if t not in (UNK, CONTROL[3])],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_k3_model(out_dir: str | Path, shape: str = "deepseek-v3", vocab: int = K3_VOCAB) -> Path:
    """`out_dir` with `shape`'s config.json (random weights: serve it with --load-format
    dummy) and the synthetic K3 tokenizer of `vocab` ids."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab)
    import transformers

    config = {
        **SHAPES[shape],
        "vocab_size": vocab,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        # As save_pretrained writes it (without it transformers takes a local tokenizer
        # for an old Mistral one and warns about its pre-tokenizer).
        "transformers_version": transformers.__version__,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    parser.add_argument("--vocab", type=int, default=K3_VOCAB)
    args = parser.parse_args(argv)
    print(build_k3_model(args.out_dir, args.shape, args.vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
