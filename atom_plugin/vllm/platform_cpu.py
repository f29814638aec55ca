from vllm.platforms.cpu import CpuPlatform

from atom_plugin.vllm.platform import AtomPlatformMixin


class AtomCpuPlatform(AtomPlatformMixin, CpuPlatform):
    """vLLM's CPU platform, which otherwise ignores `--attention-backend`."""
