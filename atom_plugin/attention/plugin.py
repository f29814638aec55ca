"""Hook implementation for the ATOM_AITER attention backends."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import AttentionBackendSpec

# (--attention-backend name, the vLLM backend class, attention kind)
BACKENDS = (
    ("ATOM_AITER", "atom_plugin.vllm.attention.mha:AtomAiterBackend", "mha"),
    ("ATOM_AITER_MLA", "atom_plugin.vllm.attention.mla:AtomAiterMLABackend", "mla"),
)


@hookimpl
def atom_attention_backends() -> list[AttentionBackendSpec]:
    return [AttentionBackendSpec(*backend) for backend in BACKENDS]
