"""A tiny DeepSeek-V2-style checkpoint (MLA attention, DeepSeek latent shapes) made locally.

Random seeded weights and a locally trained BPE tokenizer: nothing is downloaded. The
attention keeps DeepSeek's latent cache shape (kv_lora_rank 512 + rope 64 = 576 wide,
the only shape vLLM's CPU MLA decode kernel compiles for); everything else is small.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_deepseek(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    nope_dim: int = 32,
    v_dim: int = 32,
    seed: int = 0,
) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from scripts.tiny_llama import save_random_model

    return save_random_model(
        DeepseekV2ForCausalLM,
        DeepseekV2Config,
        out_dir,
        seed=seed,
        kind="deepseek_v2",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        moe_intermediate_size=hidden_size,
        first_k_dense_replace=num_layers,  # dense MLPs only: the test is about attention
        num_key_value_heads=num_heads,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim,
        head_dim=rope_dim,
        rope_scaling=None,
    )
