"""The vLLM host adapter: the only package of atom-plugin that imports vLLM."""
