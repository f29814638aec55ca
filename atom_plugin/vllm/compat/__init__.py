"""Which vLLM releases the adapter supports, and checks that a vLLM still offers what
the adapter relies on (`python -m atom_plugin.vllm.compat`, docs/conformance.md).

Nothing here imports vLLM at module level: the static check reads a vLLM source tree
or wheel that cannot be installed on this machine.
"""

from __future__ import annotations

import re

# The one declaration of the supported range: pyproject's `vllm` extra repeats it
# (a test keeps the two equal) and the adapter warns at start outside it.
SUPPORTED_VLLM_MIN = (0, 32)  # inclusive
SUPPORTED_VLLM_BELOW = (0, 35)  # exclusive
SUPPORTED_VLLM = (
    f">={'.'.join(map(str, SUPPORTED_VLLM_MIN))},<{'.'.join(map(str, SUPPORTED_VLLM_BELOW))}"
)
# The releases the checks were run on (docs/conformance.md says how).
CHECKED_RELEASES = ("0.32.0", "0.33.0", "0.34.0")


def release_tuple(version: str) -> tuple[int, ...] | None:
    """'0.33.0', '0.32.0+cpu', '0.34.0rc1.dev3' -> (0, 33, 0), ...; None if not a release."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def is_supported(version: str) -> bool:
    """True when `version` lies in SUPPORTED_VLLM (a pre-release of the upper bound
    counts as outside: it carries the next release's changes)."""
    release = release_tuple(version)
    return release is not None and SUPPORTED_VLLM_MIN <= release < SUPPORTED_VLLM_BELOW


def unsupported_message(version: str) -> str | None:
    """The start-up warning for a vLLM outside the range, or None inside it."""
    if is_supported(version):
        return None
    return (
        f"atom-plugin supports vLLM {SUPPORTED_VLLM} (checked on {', '.join(CHECKED_RELEASES)}); "
        f"this is vLLM {version}. It may still work: `python -m atom_plugin.vllm.compat` "
        "checks the adapter against the installed vLLM (docs/conformance.md)"
    )
