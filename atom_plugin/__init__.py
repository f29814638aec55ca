"""atom-plugin: ATOM's ROCm/AITER inference work as a vLLM plugin.

Core modules import without vLLM; `atom_plugin.vllm` is the only host adapter.
"""

__version__ = "0.1.0"
