"""Kimi-K3 tool-call parsing and the required tools channel."""

from atom_plugin.parsers.required_channel import START, UNCONSTRAINED, RequiredChannel

__all__ = ["START", "UNCONSTRAINED", "RequiredChannel"]
