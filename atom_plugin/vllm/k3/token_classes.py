"""The engine's vocabulary as token classes, for K3 channels that carry their calls.

A channel with calls (`extra_args`, see `atom_plugin.k3.channel_for`) steps on
the token classes of the engine's vocabulary (`atom_plugin.k3.token_classes`),
and its call table must have been compiled for them (their fingerprint). Each
logits processor starts building them from the engine's tokenizer when it is
made, on a thread of their own, so that the first request with calls does not
wait for them on the engine's step.
"""

from __future__ import annotations

import threading

from atom_plugin.k3.token_classes import TokenClasses, classes_for_tokenizer


class EngineTokenClasses:
    """`classes()` is the token classes of `vllm_config`'s tokenizer and logits width."""

    def __init__(self, vllm_config) -> None:
        self._vllm_config = vllm_config
        self._classes: TokenClasses | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._build, daemon=True).start()

    def _build(self) -> None:
        with self._lock:
            if self._classes is not None or self._error is not None:
                return
            try:
                self._classes = self._load()
            except Exception as err:  # kept for the request that needs the classes
                self._error = err

    def _load(self) -> TokenClasses:
        from vllm.tokenizers import cached_tokenizer_from_config

        model_config = self._vllm_config.model_config
        tokenizer = (
            None if model_config.skip_tokenizer_init else cached_tokenizer_from_config(model_config)
        )
        if tokenizer is None:
            raise ValueError(
                "a Kimi-K3 channel with calls needs the engine's tokenizer, and this "
                "engine has none (--skip-tokenizer-init): send channels without calls"
            )
        return classes_for_tokenizer(tokenizer, model_config.get_vocab_size())

    def __call__(self) -> TokenClasses:
        if self._classes is None:
            self._build()  # waits for the thread if it is still building
        if self._classes is None:
            raise ValueError(str(self._error)) from self._error
        return self._classes
