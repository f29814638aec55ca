"""Model shapes and workloads of the engine benchmark (benchmarks/engine.py).

A shape is a Hugging Face `config.json` and nothing else: the engine runs it with
`load_format="dummy"` (random weights) and token-id prompts, so no weights or
tokenizer are needed. A workload is a batch of same-length prompts submitted at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

_DEEPSEEK_MLA = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "moe_layer_freq": 1,
    "max_position_embeddings": 163840,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V2-Lite as published: 27 layers, 16 heads, MoE (64 routed experts, top 6).
DEEPSEEK_V2_LITE = {
    **_DEEPSEEK_MLA,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 102400,
}

# DeepSeek-V3's attention (128 heads, q_lora_rank 1536, hidden 7168) on 4 dense layers:
# the MLA decode shape of the large model at a size one GPU holds with room for KV.
DEEPSEEK_V3_ATTENTION = {
    **_DEEPSEEK_MLA,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 4,
    "vocab_size": 129280,
}

# One tensor-parallel-8 rank of DeepSeek-V3 (as DeepSeek and Kimi are served): 16 of the
# 128 query heads, V3's attention widths (q_lora_rank 1536, hidden 7168), and dense MLPs
# of 2304 columns, the TP8 share of the 8 routed and 1 shared experts a token runs
# through (9 x 2048 / 8). 16 of V3's 61 layers (`--layers` sets another count): fewer
# layers than the model, so a step's fixed host time weighs more here than in V3 itself;
# the probe's figures (host and GPU time a step) say which bounds a step.
DEEPSEEK_V3_TP8 = {
    **_DEEPSEEK_MLA,
    "hidden_size": 7168,
    "intermediate_size": 2304,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 1536,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 61,
    "vocab_size": 129280,
}

# One tensor-parallel-2 rank of DeepSeek-V3: 64 of the 128 query heads, dense MLPs of the
# TP2 share of 9 x 2048 columns. Run it with few layers (`--layers 4`) to fit several
# engines on one GPU.
DEEPSEEK_V3_TP2 = {
    **DEEPSEEK_V3_TP8,
    "intermediate_size": 9216,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
}

# A two-layer Llama for trying the harness on vLLM's CPU build.
TINY_LLAMA = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SHAPES: dict[str, dict] = {
    "tiny-llama": TINY_LLAMA,
    "llama-3.1-8b": LLAMA_8B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "deepseek-v3-attn-4l": DEEPSEEK_V3_ATTENTION,
    "deepseek-v3-tp8": DEEPSEEK_V3_TP8,
    "deepseek-v3-tp2": DEEPSEEK_V3_TP2,
}

MLA_SHAPES = frozenset(
    {"deepseek-v2-lite", "deepseek-v3-attn-4l", "deepseek-v3-tp8", "deepseek-v3-tp2"}
)


@dataclass(frozen=True)
class Workload:
    """`requests` prompts of `prompt_len` random token ids, each generating `output_len`;
    the first `shared_prefix` ids are the same in every prompt of the workload."""

    name: str
    requests: int
    prompt_len: int
    output_len: int
    what: str
    shared_prefix: int = 0

    def scaled(self, requests: int, output_len: int) -> Workload:
        return replace(self, requests=requests, output_len=output_len)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("thr-512", 128, 512, 128, "the issue's case: 128 x 512 -> 128"),
        Workload("thr-1k", 256, 1024, 256, "throughput: 256 x 1024 -> 256"),
        Workload("lat-1", 1, 1024, 256, "latency, 1 request: 1024 -> 256"),
        Workload("lat-8", 8, 1024, 256, "latency, 8 concurrent: 1024 -> 256"),
        Workload("long-16k", 8, 16384, 512, "long context, decode-heavy: 8 x 16K -> 512"),
        Workload("mixed-4k", 64, 4096, 256, "chunked prefill mixed with decode: 64 x 4K -> 256"),
        Workload("decode-2k", 64, 2048, 512, "decode-heavy: 64 x 2K -> 512"),
        Workload(
            "shared-8k",
            8,
            8192 + 256,
            256,
            "a long shared prefix: 8 x (8K shared + 256 own) -> 256",
            shared_prefix=8192,
        ),
    )
}


def shape_config(name: str, layers: int | None = None) -> dict:
    """Shape `name`'s config; `layers` replaces its layer count (dense layers stay dense)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    config = dict(SHAPES[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        config["num_hidden_layers"] = layers
    return config


def write_shape(name: str, root: Path, layers: int | None = None) -> Path:
    """The folder holding shape `name`'s config.json (made under `root` if absent), with
    `layers` layers when given."""
    config = shape_config(name, layers)
    folder = root / (name if layers is None else f"{name}-{layers}l")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def parse_workloads(names: str) -> list[Workload]:
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in picked]
