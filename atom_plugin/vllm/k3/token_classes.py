"""The engine's vocabulary as token classes, for K3 channels that carry their calls.

A channel with calls (`extra_args`, see `atom_plugin.k3.channel_for`) steps on
the token classes of the engine's vocabulary (`atom_plugin.k3.token_classes`).
Each logits processor builds them once, from the engine's tokenizer, the first time
a request brings calls: requests without calls never load them.
"""

from __future__ import annotations

from atom_plugin.k3.token_classes import TokenClasses, classes_for_tokenizer


class EngineTokenClasses:
    """`classes()` is the token classes of `vllm_config`'s tokenizer and logits width."""

    def __init__(self, vllm_config) -> None:
        self._vllm_config = vllm_config
        self._classes: TokenClasses | None = None

    def __call__(self) -> TokenClasses:
        if self._classes is None:
            from vllm.tokenizers import cached_tokenizer_from_config

            model_config = self._vllm_config.model_config
            tokenizer = cached_tokenizer_from_config(model_config)
            if tokenizer is None:
                raise ValueError(
                    "a Kimi-K3 channel with calls needs the engine's tokenizer, and this "
                    "engine has none (--skip-tokenizer-init): send channels without calls"
                )
            self._classes = classes_for_tokenizer(tokenizer, model_config.get_vocab_size())
        return self._classes
