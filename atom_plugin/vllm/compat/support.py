"""The support matrix: each vLLM release x each capability x where it was run.

The one source of the README's table (a test keeps the two equal) and of
`atom-plugin info --support`. A cell says where the capability ran on that release:
CI (the whole suite on vLLM's CPU build, every commit), a GPU run (device and date), or
only the check of the adapter against the release's sources in CI
(`python -m atom_plugin.vllm.compat --source`); "no" says why it does not run there.
"""

from __future__ import annotations

CAPABILITIES = (
    "MHA backend (ATOM_AITER)",
    "MLA backend (ATOM_AITER_MLA)",
    "K3 tool-call channel",
    "two-batch overlap",
    "doctor",
)
CI = "CI (CPU build)"
STATIC = "source check in CI"
DOCTOR = "independent of vLLM"

# release -> one cell per capability, in CAPABILITIES order
SUPPORT: dict[str, tuple[str, ...]] = {
    "0.32": (
        f"{CI}, H200 2026-12-03",
        f"{CI}, H200 2026-12-03",
        f"{CI}, H200 2026-12-03",
        f"{CI}, H200 2026-12-03 (V1 runner); Model Runner V2: {STATIC}",
        DOCTOR,
    ),
    "0.33": (STATIC, STATIC, STATIC, STATIC, DOCTOR),
    "0.34": (
        f"{STATIC}, H100 2026-12-05",
        f"{STATIC}, H100 2026-12-05",
        f"{STATIC}, H100 2026-12-05",
        f"{STATIC}, H100 2026-12-05 (Model Runner V2)",
        DOCTOR,
    ),
}


def matrix_markdown() -> str:
    """The matrix as a Markdown table (the README's)."""
    releases = list(SUPPORT)
    head = "| capability | " + " | ".join(f"vLLM {r}" for r in releases) + " |"
    rule = "|---" * (len(releases) + 1) + "|"
    rows = [
        f"| {capability} | " + " | ".join(SUPPORT[r][i] for r in releases) + " |"
        for i, capability in enumerate(CAPABILITIES)
    ]
    return "\n".join([head, rule, *rows])
