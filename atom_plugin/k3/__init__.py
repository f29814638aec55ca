"""Kimi-K3 tool-call parsing and the required tools channel.

The Triton parts (`channel_kernel`, `spec_rows`) are imported from their
modules, so importing this package never compiles or loads a kernel.
"""

from atom_plugin.k3.channel_tables import (
    ChannelTables,
    compile_channel,
    compile_channels,
    next_states,
)
from atom_plugin.k3.required_channel import START, UNCONSTRAINED, RequiredChannel

__all__ = [
    "START",
    "UNCONSTRAINED",
    "ChannelTables",
    "RequiredChannel",
    "compile_channel",
    "compile_channels",
    "next_states",
]
