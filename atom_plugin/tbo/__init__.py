"""Two-batch overlap: one decode split, DP agreement, micro-batch runner, request graphs."""

from atom_plugin.tbo.split import decode_bucket_splits, decode_ubatch_request_ranges

__all__ = ["decode_bucket_splits", "decode_ubatch_request_ranges"]
