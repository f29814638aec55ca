from vllm.platforms.rocm import RocmPlatform

from atom_plugin.vllm.platform import AtomPlatformMixin


class AtomRocmPlatform(AtomPlatformMixin, RocmPlatform):
    """vLLM's ROCm platform with the plugin's backends and processors."""
