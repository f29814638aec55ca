"""A tiny Mixtral-style mixture-of-experts checkpoint made locally (random seeded weights)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_moe(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    num_experts: int = 4,
    experts_per_token: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random-weight Mixtral (GQA, `num_experts` experts, top-`experts_per_token`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from scripts.tiny_llama import save_random_model

    return save_random_model(
        MixtralForCausalLM,
        MixtralConfig,
        out_dir,
        seed=seed,
        kind="mixtral",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_local_experts=num_experts,
        num_experts_per_tok=experts_per_token,
    )
