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
    moe_from_layer: int | None = None,
    num_experts: int = 4,
    experts_per_token: int = 2,
    seed: int = 0,
    max_positions: int = 1024,
) -> Path:
    """`moe_from_layer`: layers from that one on are MoE (`num_experts` routed experts, top
    `experts_per_token`, one shared expert); None keeps every layer's MLP dense."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from scripts.tiny_llama import save_random_model

    moe = {}
    if moe_from_layer is not None:
        moe = dict(
            n_routed_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            n_shared_experts=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            moe_layer_freq=1,
        )
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
        first_k_dense_replace=num_layers if moe_from_layer is None else moe_from_layer,
        **moe,
        num_key_value_heads=num_heads,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim,
        head_dim=rope_dim,
        rope_scaling=None,
        max_position_embeddings=max_positions,
    )
