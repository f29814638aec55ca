"""`atom-plugin info` and the CLI's usage errors, through the real entry point."""

from __future__ import annotations

import subprocess
import sys

import torch

import atom_plugin


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atom_plugin", *args], capture_output=True, text=True, timeout=120
    )


def test_info_lists_version_platform_and_every_hook():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"atom-plugin {atom_plugin.__version__}" in out
    assert "platform: cpu" in out
    assert "aiter available: no" in out
    assert "triton available: " in out
    assert "hopper MLA decode (Gluon): " in out
    if not torch.cuda.is_available():
        assert "hopper MLA decode (Gluon): no (no CUDA GPU)" in out
    for line in (
        "atom_plugin.attention.plugin: atom_attention_backends",
        "ATOM_AITER (mha) -> atom_plugin.vllm.attention.mha:AtomAiterBackend",
        "ATOM_AITER_MLA (mla) -> atom_plugin.vllm.attention.mla:AtomAiterMLABackend",
        "atom_kimi_k3 -> ",
        "micro-batch runner: ",
        "two-batch overlap: --additional-config "
        """'{"atom_plugin": {"tbo": "off|prefill|decode|all"}}'""",
    ):
        assert line in out
    assert "micro-batch runner: (none)" not in out


def test_unknown_command_exits_2_naming_the_choices():
    proc = run_cli("inf")
    assert proc.returncode == 2
    assert "invalid choice: 'inf'" in proc.stderr
    assert "info" in proc.stderr and "doctor" in proc.stderr


def test_no_command_exits_2():
    proc = run_cli()
    assert proc.returncode == 2
    assert "required" in proc.stderr


def test_version_flag():
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"atom-plugin {atom_plugin.__version__}"
