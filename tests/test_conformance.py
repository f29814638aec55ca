"""The shipped conformance suite: the project's own implementations pass it; a third-party
package installed into a temporary virtual environment is discovered through its entry
point, and its faults are named (implementation, contract item, case)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from atom_plugin import manager
from atom_plugin.conformance import MissingDependency, checks
from atom_plugin.conformance.cases import ATTENTION_CASES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def builtin_checks():
    pm = manager.new_plugin_manager(load_entry_points=False)
    return checks(pm)


def test_every_builtin_implementation_is_checked(builtin_checks):
    labels = {c.implementation.split(" (")[0] for c in builtin_checks}
    assert labels == {
        "attention backend ATOM_AITER",
        "attention backend ATOM_AITER_MLA",
        "tool parser atom_kimi_k3",
        "logits processor atom_k3_required_channel [v1]",
        "logits processor atom_k3_required_channel [mrv2]",
        "health probe rocm",
        "health probe amd",
        "health probe nvidia",
    }


def test_builtin_implementations_meet_their_contracts(builtin_checks):
    for check in builtin_checks:
        findings = list(check.run())
        assert findings, check.implementation
        failures = [f for f in findings if not f.ok]
        assert not failures, "\n".join(map(str, failures))
        if check.implementation.startswith("attention backend ATOM_AITER ("):
            compared = {f.case for f in findings if f.item == "output equals the torch reference"}
            assert compared == {case.name for case in ATTENTION_CASES}


def test_the_reference_comparison_can_fail(monkeypatch):
    """An impl whose output is off by a little fails the comparison, naming the case."""
    from atom_plugin.conformance.attention import check_backend
    from atom_plugin.specs import AttentionBackendSpec
    from atom_plugin.vllm.attention.mha import AtomAiterImpl

    forward = AtomAiterImpl.forward

    def off_by_a_little(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if args[5] is not None:  # attn_metadata: not the profiling run
            out.add_(1e-2)
        return out

    monkeypatch.setattr(AtomAiterImpl, "forward", off_by_a_little)
    path = "atom_plugin.vllm.attention.mha:AtomAiterBackend"
    spec = AttentionBackendSpec("ATOM_AITER", path, "mha")
    failed = {(f.item, f.case) for f in check_backend(spec, "x") if not f.ok}
    assert failed == {("output equals the torch reference", c.name) for c in ATTENTION_CASES}


def test_missing_hypothesis_is_a_clear_error(monkeypatch, builtin_checks):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    parser = next(c for c in builtin_checks if c.implementation.startswith("tool parser"))
    with pytest.raises(MissingDependency, match=r"need hypothesis.*atom-plugin\[conformance\]"):
        list(parser.run())


def test_an_unknown_plugin_is_refused_listing_the_names():
    proc = subprocess.run(
        [sys.executable, "-m", "atom_plugin", "conformance", "--plugin", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2
    assert "--plugin 'nope' is not one of" in proc.stderr
    assert "atom_plugin.attention.plugin" in proc.stderr


# A third-party package, installed for real -------------------------------------------

ENTRY_POINTS = "[atom_plugin]\ntp_atom = tp_atom.hooks\n"

HOOKS = """
from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import AttentionBackendSpec, ToolParserSpec


@hookimpl
def atom_attention_backends():
    return [
        AttentionBackendSpec("TP_GOOD", "tp_atom.backends:GoodBackend", "mha"),
        AttentionBackendSpec("TP_PADDING_BLIND", "tp_atom.backends:PaddingBlindBackend", "mha"),
    ]


@hookimpl
def atom_tool_parsers():
    sample = 'Sure.<tool_call>{"name": "ping", "arguments": {"n": 1}}</tool_call>'
    return [ToolParserSpec("tp_fragile", "tp_atom.parsers:FragileParser", samples=(sample,))]
"""

BACKENDS = '''
"""A good backend (vLLM's contract, the project's kernels) and one whose KV write ignores
padding rows: slot -1 is indexed like any other and lands on the last block's last row."""

from atom_plugin.vllm.attention.mha import AtomAiterBackend, AtomAiterImpl


class GoodBackend(AtomAiterBackend):
    @staticmethod
    def get_name():
        return "TP_GOOD"


class PaddingBlindImpl(AtomAiterImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = self._caches(kv_cache)
        block = key_cache.shape[1]
        key_cache[slot_mapping // block, slot_mapping % block] = key
        value_cache[slot_mapping // block, slot_mapping % block] = value


class PaddingBlindBackend(AtomAiterBackend):
    @staticmethod
    def get_name():
        return "TP_PADDING_BLIND"

    @staticmethod
    def get_impl_cls():
        return PaddingBlindImpl
'''

PARSERS = '''
"""A parser that trusts its input: json.loads on whatever follows <tool_call>."""

import json

from vllm.entrypoints.generate.base.protocol import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser


class FragileParser(ToolParser):
    def extract_tool_calls(self, model_output, request):
        head, tag, rest = model_output.partition("<tool_call>")
        if not tag:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=model_output
            )
        call = json.loads(rest.split("</tool_call>")[0])
        function = FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"]))
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[ToolCall(type="function", function=function)],
            content=head or None,
        )

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, *args):
        return DeltaMessage(content=delta_text)
'''


def build_wheel(folder: Path, sources: dict[str, str]) -> Path:
    """tp-atom as a wheel (a zip with a dist-info naming its entry point): pip installs
    it like any package from an index, with no build backend involved."""
    dist = "tp_atom-0.1.dist-info"
    files = {f"tp_atom/{name}.py": textwrap.dedent(text) for name, text in sources.items()}
    files[f"{dist}/METADATA"] = "Metadata-Version: 2.1\nName: tp-atom\nVersion: 0.1\n"
    files[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist}/entry_points.txt"] = ENTRY_POINTS
    record = [f"{name},," for name in files] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / "tp_atom-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


@pytest.fixture(scope="module")
def third_party_venv(tmp_path_factory):
    """A fresh venv that sees this interpreter's packages (vLLM, torch, pip) through a
    .pth file, with `tp-atom` pip-installed into it: a dist-info with real entry points."""
    tmp = tmp_path_factory.mktemp("third-party")
    sources = {"__init__": "", "hooks": HOOKS, "backends": BACKENDS, "parsers": PARSERS}
    wheel = build_wheel(tmp, sources)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "shared_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert (Path(purelib) / "tp_atom" / "hooks.py").is_file()
    return python


def run_in(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    environ.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, timeout=600, env=environ
    )


@pytest.mark.vllm
def test_conformance_command_names_the_third_party_faults(third_party_venv):
    proc = run_in(third_party_venv, "-m", "atom_plugin", "conformance", "--plugin", "tp_atom")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    blocks = dict((block.splitlines()[0], block) for block in ("\n" + out).split("\nchecking ")[1:])
    good = blocks["attention backend TP_GOOD (tp_atom) ..."]
    assert good.splitlines()[-1].strip().startswith("ok ("), good
    blind = blocks["attention backend TP_PADDING_BLIND (tp_atom) ..."]
    fails = [line.strip() for line in blind.splitlines() if line.strip().startswith("FAIL")]
    assert fails, blind
    assert all(" | padding_rows" in line for line in fails), fails
    assert any(
        "| kv write touches only scheduled slots | padding_rows: cache blocks" in line
        for line in fails
    ), fails
    parser = blocks["tool parser tp_fragile (tp_atom) ..."]
    assert (
        "FAIL tool parser tp_fragile (tp_atom) | never raises on truncated output "
        "(non-streaming) | sample 0 cut at 16 of 67 chars: 'Sure.<tool_call>'" in parser
    ), parser
    assert "JSONDecodeError" in parser
    assert out.strip().splitlines()[-1].startswith("3 implementations,")


@pytest.mark.vllm
def test_pytest_entry_point_runs_the_suite_in_a_third_party_env(third_party_venv, tmp_path):
    proc = run_in(
        third_party_venv,
        "-m",
        "pytest",
        "--pyargs",
        "atom_plugin.conformance",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(tmp_path),
        ATOM_PLUGIN_CONFORMANCE_PLUGIN="tp_atom",
    )
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    assert "2 failed, 1 passed" in out, out[-4000:]
    assert "FAILED" in out and "TP_PADDING_BLIND" in out and "tp_fragile" in out
    assert "kv write touches only scheduled slots | padding_rows" in out
