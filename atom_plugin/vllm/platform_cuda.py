from vllm.platforms.cuda import CudaPlatform

from atom_plugin.vllm.platform import AtomPlatformMixin


class AtomCudaPlatform(AtomPlatformMixin, CudaPlatform):
    """vLLM's CUDA platform with the plugin's backends and processors."""
