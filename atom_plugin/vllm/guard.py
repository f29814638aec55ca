"""Never break the host: each of the plugin's set-up steps inside vLLM runs through `setup_step`.

A step nobody asked for (the platform subclass, the backend names, the K3 channel's logits
processors, which every engine gets) that fails on some vLLM logs one line and stands
aside: vLLM then runs as it would without the plugin. A step the user asked for
(`--attention-backend atom_aiter`, an `atom_plugin` `tbo` setting) that fails stops the
start with an error naming the feature, the vLLM release and what to do. Deliberate
refusals (`PluginRefusal`: a setting this engine cannot serve) pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from atom_plugin.vllm.compat import SUPPORTED_VLLM

logger = logging.getLogger("vllm.atom_plugin")

# The steps that stood aside in this process (each warns once).
_stood_aside: set[str] = set()


class PluginRefusal(ValueError):
    """A plugin feature the user asked for cannot serve this engine; the message says why
    and what works instead."""


def running_vllm() -> str:
    """The running vLLM's version, or 'unknown' where even that cannot be read."""
    try:
        from vllm import __version__
    except Exception:  # a vLLM this broken is reported by vLLM itself
        return "unknown"
    return str(__version__)


@contextmanager
def setup_step(what: str, asked_by: str | None = None) -> Iterator[None]:
    """Run one set-up step. `what` names what it provides ("the K3 channel's logits
    processors"); `asked_by` is the user's setting that asked for it, None when nobody did.

    An unasked step's failure is swallowed after one warning: code after the `with` block
    runs, so a step that returns a value inside the block falls through to a default.
    """
    try:
        yield
    except PluginRefusal:
        raise
    except Exception as exc:
        release = running_vllm()
        why = f"{type(exc).__name__}: {exc}"
        if asked_by is not None:
            raise RuntimeError(
                f"atom-plugin cannot provide {what} (asked for by {asked_by}) on vLLM "
                f"{release}: {why}. atom-plugin supports vLLM {SUPPORTED_VLLM}; "
                "`python -m atom_plugin.vllm.compat` lists what this vLLM lacks. "
                f"Use a supported vLLM or a newer atom-plugin, or drop {asked_by}"
            ) from exc
        if what not in _stood_aside:
            logger.warning(
                "atom-plugin could not set up %s on vLLM %s (%s) and stands aside: vLLM runs "
                "as it would without it. `python -m atom_plugin.vllm.compat` checks this vLLM; "
                "ATOM_PLUGIN_DISABLE=1 turns the plugin off",
                what,
                release,
                why,
            )
        _stood_aside.add(what)
