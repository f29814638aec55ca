"""The plugin manager, the hook specs, and a third-party plugin reaching vLLM."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pluggy
import pytest

from atom_plugin import manager
from atom_plugin.hookspecs import PROJECT, hookimpl
from atom_plugin.specs import AttentionBackendSpec, LogitsProcessorSpec, ToolParserSpec
from tests.engine import engine_env


def test_builtin_parts_are_hook_implementations():
    pm = manager.new_plugin_manager(load_entry_points=False)
    assert sorted(name for name, _ in pm.list_name_plugin()) == sorted(manager.BUILTIN_PLUGINS)
    names = {spec.name: spec.kind for spec in manager.attention_backends(pm)}
    assert names == {"ATOM_AITER": "mha", "ATOM_AITER_MLA": "mla"}
    assert "atom_kimi_k3" in {spec.name for spec in manager.tool_parsers(pm)}
    assert {spec.runner for spec in manager.logits_processors(pm)} == {"v1", "mrv2"}
    assert manager.microbatch_runner(pm) is not None
    assert {"rocm", "amd", "nvidia"} <= {spec.smi for spec in manager.health_probes(pm)}


def with_extra_backend(spec: AttentionBackendSpec) -> pluggy.PluginManager:
    """The built-in parts plus one more plugin that offers `spec`."""
    plugin = types.SimpleNamespace(atom_attention_backends=hookimpl(lambda: [spec]))
    pm = manager.new_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="extra")
    return pm


def test_an_extra_implementation_is_collected():
    pm = with_extra_backend(AttentionBackendSpec("EXTRA_ATTN", "pkg.mod:Extra", "mha"))
    assert "EXTRA_ATTN" in {spec.name for spec in manager.attention_backends(pm)}


def test_two_backends_with_one_name_are_refused():
    pm = with_extra_backend(AttentionBackendSpec("ATOM_AITER", "other.mod:Other", "mha"))
    with pytest.raises(ValueError, match="two attention backends are named 'ATOM_AITER'"):
        manager.attention_backends(pm)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: AttentionBackendSpec("atom_lower", "a.b:C", "mha"), "must be upper case"),
        (lambda: AttentionBackendSpec("X", "a.b.C", "mha"), "'package.module:Name'"),
        (lambda: AttentionBackendSpec("X", "a.b:C", "gqa"), "'gqa' is not one of mha, mla"),
        (lambda: LogitsProcessorSpec("p", "a.b:C", "v3"), "'v3' is not one of v1, mrv2"),
        (lambda: ToolParserSpec("p", "nocolon"), "'nocolon' must look like"),
    ],
)
def test_bad_specs_name_the_value_and_the_choices(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_hookspecs_cover_every_capability():
    pm = pluggy.PluginManager(PROJECT)
    from atom_plugin import hookspecs

    pm.add_hookspecs(hookspecs)
    assert {name for name in dir(pm.hook) if name.startswith("atom_")} == {
        "atom_attention_backends",
        "atom_logits_processors",
        "atom_tool_parsers",
        "atom_microbatch_runner",
        "atom_health_probes",
    }


THIRD_PARTY = textwrap.dedent(
    """
    from atom_plugin.hookspecs import hookimpl
    from atom_plugin.specs import AttentionBackendSpec, ToolParserSpec

    @hookimpl
    def atom_attention_backends():
        return [AttentionBackendSpec("THIRD_PARTY_ATTN", "third_party_atom:Backend", "mha")]

    @hookimpl
    def atom_tool_parsers():
        return [ToolParserSpec("third_party_parser", "third_party_atom:Parser")]
    """
)

CHECK_IN_VLLM = textwrap.dedent(
    """
    from vllm.platforms import current_platform   # runs the platform plugins
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.tool_parsers import ToolParserManager

    load_general_plugins()
    member = AttentionBackendEnum["THIRD_PARTY_ATTN"]
    print("backend", member.name, member.value)
    print("parser", ToolParserManager.lazy_parsers["third_party_parser"])
    print("platform", type(current_platform).__name__)
    """
)


@pytest.fixture
def third_party_site(tmp_path):
    """A package installed the way pip would: a module plus a dist-info with entry points."""
    (tmp_path / "third_party_atom.py").write_text(THIRD_PARTY)
    dist = tmp_path / "third_party_atom-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-atom\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[atom_plugin]\nthird_party = third_party_atom\n")
    return tmp_path


def test_third_party_entry_point_reaches_vllm(third_party_site):
    env = engine_env(PYTHONPATH=str(third_party_site))
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_IN_VLLM], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend THIRD_PARTY_ATTN third_party_atom.Backend" in proc.stdout
    assert "parser ('third_party_atom', 'Parser')" in proc.stdout
    assert "platform AtomCpuPlatform" in proc.stdout


PLATFORM_ONLY = textwrap.dedent(
    """
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    load_general_plugins()
    print(type(current_platform).__name__, "ATOM_AITER" in AttentionBackendEnum.__members__)
    """
)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "AtomCpuPlatform True"),
        ({"ATOM_PLUGIN_DISABLE": "1"}, "CpuPlatform False"),
        ({"VLLM_PLUGINS": "some_other_plugin"}, "CpuPlatform False"),
        ({"VLLM_PLUGINS": "atom_plugin"}, "AtomCpuPlatform True"),
    ],
)
def test_disable_switch_and_vllm_allow_list(env, expected):
    proc = subprocess.run(
        [sys.executable, "-c", PLATFORM_ONLY],
        capture_output=True,
        text=True,
        env=engine_env(**env),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == expected


def test_a_bad_disable_value_is_refused(monkeypatch):
    from atom_plugin.vllm.registration import plugin_disabled

    monkeypatch.setenv("ATOM_PLUGIN_DISABLE", "maybe")
    with pytest.raises(ValueError, match="ATOM_PLUGIN_DISABLE='maybe' is not understood"):
        plugin_disabled()


def test_registration_is_idempotent():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from atom_plugin.vllm.registration import register_attention_backends

    register_attention_backends()
    register_attention_backends()
    assert AttentionBackendEnum["ATOM_AITER"].value == (
        "atom_plugin.vllm.attention.mha.AtomAiterBackend"
    )
