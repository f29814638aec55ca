"""The vLLM side of the conformance suite (`atom_plugin.conformance`): the vLLM objects
its checks build and the vLLM calls they make, one module per capability. The checks
themselves, and what they compare, live in `atom_plugin.conformance`."""
