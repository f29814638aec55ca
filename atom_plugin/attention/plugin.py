"""Hook implementation for the ATOM_AITER attention backends."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import AttentionBackendSpec


@hookimpl
def atom_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="ATOM_AITER",
            class_path="atom_plugin.vllm.attention.mha:AtomAiterBackend",
            kind="mha",
        ),
        AttentionBackendSpec(
            name="ATOM_AITER_MLA",
            class_path="atom_plugin.vllm.attention.mla:AtomAiterMLABackend",
            kind="mla",
        ),
    ]
