"""The MHA batch builders live in the package (the conformance suite runs third-party
backends on them); the tests import them from here as before."""

from atom_plugin.conformance.cases import (  # noqa: F401
    Batch,
    make_batch,
    paged_layout,
    tolerance,
    vllm_kv_cache,
)
