"""The TBO test harness: a small MoE-style model on the plugin's attention ops, the
micro-batch metadata and graph buffers only tests and benchmarks use, and the faults
put into vLLM engines under test."""
