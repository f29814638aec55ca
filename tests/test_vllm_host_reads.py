"""Host-API conformance, attribute reads and function arities: the adapter's reads of vLLM
configs and of `self` attributes vLLM's base classes set, and its calls of vLLM's
module-level functions, against the installed vLLM 0.32 (imported and read as source), a
signature-only cut of 0.34.0 (tests/fixtures/vllm_0_34_api) and throwaway adapters with
planted faults. The adapter as it was before the 0.34 work is taken from git (7b425cd)."""

from __future__ import annotations

import re
import subprocess
import textwrap

import pytest

from atom_plugin.vllm.compat.check import Adapter, Coverage, check
from atom_plugin.vllm.compat.hosts import (
    ATTRIBUTES_MARK,
    STUB_MARK,
    ClassRef,
    SourceHost,
)
from tests.conftest import installed_vllm_tree
from tests.test_vllm_host_api import ROOT, throwaway

FIXTURE_034 = ROOT / "tests" / "fixtures" / "vllm_0_34_api"
# main before the 0.34 work: every vLLM 0.34 start with the plugin installed raised there.
BEFORE_034 = "7b425cd"


@pytest.fixture(scope="module")
def host_034():
    host = SourceHost(FIXTURE_034, partial=True)
    assert host.version() == "0.34.0"
    return host


@pytest.fixture(scope="module")
def adapter_before_034(tmp_path_factory) -> Adapter:
    """The adapter package as commit 7b425cd holds it, out of git."""
    root = tmp_path_factory.mktemp("before_034")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", BEFORE_034, "atom_plugin"],
        capture_output=True,
        timeout=60,
    )
    if archive.returncode != 0:
        pytest.fail(
            f"git archive {BEFORE_034} failed (this test needs the project's git history, "
            f"a full clone): {archive.stderr.decode().strip()}"
        )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True, timeout=60)
    return Adapter(root)


def marked(source: str) -> set[tuple[int, str]]:
    """(line, name) for each name listed by a `# reported: a, b` comment of `source`."""
    out = set()
    for number, line in enumerate(source.splitlines(), 1):
        if "# reported:" in line:
            for name in line.split("# reported:")[1].split(","):
                out.add((number, name.strip()))
    return out


def line_of(source: str, text: str) -> int:
    (number,) = [n for n, line in enumerate(source.splitlines(), 1) if text in line]
    return number


def reported_reads(problems, where_prefix: str) -> set[tuple[int, str]]:
    out = set()
    for p in problems:
        assert p.kind == "attribute" and p.where.startswith(where_prefix), p
        name = re.search(r"has no attribute '(\w+)'|reads (?:self|cls)\.(\w+)", p.detail)
        out.add((int(p.where.split(":")[1].split()[0]), name.group(1) or name.group(2)))
    return out


# The adapter before the 0.34 work, and today's --------------------------------------


def test_034_cut_names_the_034_crash_of_the_adapter_before_the_034_work(
    adapter_before_034, host_034
):
    coverage = Coverage()
    problems = check(host_034, adapter_before_034, coverage)
    text = "\n".join(map(str, problems))
    assert sorted((p.kind, p.where) for p in problems) == [
        ("attribute", "atom_plugin/vllm/platform.py:87 AtomPlatformMixin.model_runner"),
        ("attribute", "atom_plugin/vllm/tbo/setup.py:43 tbo_refusal"),
        ("attribute", "atom_plugin/vllm/tbo/worker_gpu.py:25 AtomTboGPUWorker._make_model_runner"),
        ("function", "atom_plugin/vllm/tbo/worker_gpu.py:25 AtomTboGPUWorker._make_model_runner"),
    ], text
    # The read every start makes (check_and_update_config -> model_runner) is named...
    platform = next(p for p in problems if "platform.py" in p.where)
    assert platform.detail == (
        "reads vllm_config.use_v2_model_runner: vllm.config.vllm.VllmConfig has no attribute "
        "'use_v2_model_runner'"
    ), text
    # ...the worker's own read, and the call that passes the removed argument.
    worker = {p.kind: p.detail for p in problems if "worker_gpu" in p.where}
    assert "reads self.use_v2_model_runner" in worker["attribute"], text
    assert "vllm.v1.worker.gpu_worker.Worker" in worker["attribute"], text
    assert "calls _num_workspace_lanes(2 positional)" in worker["function"], text
    assert "passes 2 positional argument(s); 1 accepted" in worker["function"], text
    assert coverage.attribute_reads > 0 and coverage.function_calls > 0


def test_the_adapter_before_the_034_work_passes_on_032(adapter_before_034, source_host_032):
    """0.32 has what it reads and calls: the 0.34 findings come from the host."""
    problems = check(source_host_032, adapter_before_034)
    assert problems == [], "\n".join(map(str, problems))


def test_adapter_conforms_to_the_034_cut(host_034):
    coverage = Coverage()
    problems = check(host_034, Adapter(ROOT), coverage)
    assert problems == [], "\n".join(map(str, problems))
    # The V1 runner's modules are left to the releases that have that runner.
    assert "atom_plugin.vllm.tbo.worker_gpu" in coverage.skipped
    assert "atom_plugin.vllm.k3.logits_v1" in coverage.skipped


# Config reads ------------------------------------------------------------------------

CONFIG_READS = textwrap.dedent(
    """
    from vllm.config import VllmConfig
    from vllm.config.parallel import ParallelConfig


    def plain(vllm_config, runner):
        runner.vllm_config.no_such_mode  # reported: no_such_mode
        return vllm_config.no_such_section  # reported: no_such_section


    def chain(vllm_config):
        vllm_config.parallel_config.no_such_knob = 1  # reported: no_such_knob
        return vllm_config.model_config.max_model_len


    def variables(vllm_config):
        parallel, model = vllm_config.parallel_config, vllm_config.model_config
        scheduler = vllm_config.scheduler_config
        tail = model.is_encoder_decoder, scheduler.max_num_seqs
        return parallel.no_such_size, tail  # reported: no_such_size


    def annotated(cfg: VllmConfig, par: "ParallelConfig"):
        size = par.world_size
        return cfg.no_such_flag, par.no_such_rank, size  # reported: no_such_flag, no_such_rank


    def probes(vllm_config):
        found = getattr(vllm_config, "no_such_a", None)
        if hasattr(vllm_config.model_config, "no_such_b"):
            found = vllm_config.model_config.no_such_b
        try:
            found = vllm_config.no_such_c
        except (KeyError, AttributeError):
            pass
        return found, getattr(vllm_config, "no_such_d")  # reported: no_such_d


    def not_configs(config, settings, parallel):
        parallel = settings.tbo
        return config.anything, settings.vllm_configs, parallel.anything


    class Holder:
        def __init__(self, vllm_config):
            self._vllm_config = vllm_config

        def read(self):
            model_config = self._vllm_config.model_config
            vocab = model_config.get_vocab_size()
            return vocab, model_config.no_such_method()  # reported: no_such_method
    """
)


@pytest.mark.parametrize("which", ["installed", "source"])
def test_config_reads_the_host_lacks_are_named_and_probes_are_not(
    tmp_path, which, installed_host, source_host_032
):
    host = installed_host if which == "installed" else source_host_032
    adapter, where = throwaway(tmp_path, "config_adapter", CONFIG_READS)
    coverage = Coverage()
    problems = check(host, adapter, coverage)
    assert reported_reads(problems, where) == marked(CONFIG_READS), "\n".join(map(str, problems))
    owners = {p.detail.split(": ")[1].split(" has")[0] for p in problems}
    assert owners == {
        "vllm.config.vllm.VllmConfig",
        "vllm.config.parallel.ParallelConfig",
        "vllm.config.model.ModelConfig",
    }
    # the reads that exist were compared too (max_model_len, is_encoder_decoder, ...)
    assert coverage.attribute_reads >= len(marked(CONFIG_READS)) + 6


# `self` reads --------------------------------------------------------------------------

SELF_READS = textwrap.dedent(
    """
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.gpu_worker import Worker


    class CountingMixin:
        def counted(self):
            return self.model_runner, self.no_such_runner  # reported: no_such_runner


    class PlantedWorker(CountingMixin, Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.mine = 0

        def read(self):
            if hasattr(self, "no_such_probe"):
                return self.no_such_probe
            got = self.mine, self.vllm_config, self.init_device, self.__class__
            return got, self.no_such_attr  # reported: no_such_attr

        @staticmethod
        def helper(other):
            return other.anything


    class PlantedPlatform(CpuPlatform):
        @classmethod
        def planted_kind(cls):
            known = cls.device_type, cls.get_device_capability
            return known, cls.no_such_field  # reported: no_such_field


    class Opaque(torch.nn.Module, Worker):
        def read(self):
            return self.anything  # a base outside vLLM: not checked
    """
)


@pytest.mark.parametrize("which", ["installed", "source"])
def test_self_reads_no_class_of_the_mro_sets_are_named(
    tmp_path, which, installed_host, source_host_032
):
    host = installed_host if which == "installed" else source_host_032
    adapter, where = throwaway(tmp_path, "self_adapter", SELF_READS)
    problems = check(host, adapter)
    assert reported_reads(problems, where) == marked(SELF_READS), "\n".join(map(str, problems))
    labels = sorted(p.where.split(" ", 1)[1] for p in problems)
    assert labels == [
        "CountingMixin (in PlantedWorker).counted",
        "PlantedPlatform.planted_kind",
        "PlantedWorker.read",
    ]
    assert "cls.no_such_field" in next(p.detail for p in problems if "Platform" in p.where)


# Function arities -------------------------------------------------------------------

FUNCTION_CALLS = textwrap.dedent(
    """
    from vllm.v1.worker import workspace
    from vllm.v1.worker.workspace import init_workspace_manager as init_ws


    def start(vllm_config, device):
        from vllm.v1.worker.gpu_worker import _num_workspace_lanes

        lanes = _num_workspace_lanes(vllm_config)  # 0.34's one parameter; 0.32 has two
        init_ws(device, 2, lanes, alloc_context=None)
        workspace.init_workspace_manager(device, num_lanes=lanes, no_such_option=1)
        return init_ws(device, 1, 2, 3, 4)  # five positional
    """
)


def test_calls_of_vllm_functions_bind_to_each_release_signature(
    tmp_path, host_034, installed_host, source_host_032
):
    adapter, where = throwaway(tmp_path, "call_adapter", FUNCTION_CALLS)
    findings = {}
    for name, host in (
        ("0.34", host_034),
        ("installed", installed_host),
        ("0.32", source_host_032),
    ):
        coverage = Coverage()
        problems = check(host, adapter, coverage)
        assert {p.kind for p in problems} == {"function"}, problems
        assert coverage.function_calls == 4, name
        assert all(p.where.startswith(f"{where}:") and p.where.endswith(" start") for p in problems)
        findings[name] = {(int(p.where.split(":")[1].split()[0]), p.detail) for p in problems}
    shared = {
        (
            line_of(FUNCTION_CALLS, "no_such_option"),
            "passes keyword 'no_such_option', which is not a parameter",
        ),
        (line_of(FUNCTION_CALLS, "five positional"), "passes 5 positional argument(s); 4 accepted"),
    }
    only_032 = (
        line_of(FUNCTION_CALLS, "0.32 has two"),
        "leaves required 'use_v2_model_runner' unfilled",
    )
    for name, expected in (("0.34", shared), ("installed", shared | {only_032})):
        got = {(line, detail.rsplit(": ", 1)[1]) for line, detail in findings[name]}
        assert got == expected, (name, findings[name])
    assert findings["0.32"] == findings["installed"]
    assert any(
        "host vllm.v1.worker.workspace.init_workspace_manager(" in d for _, d in findings["0.34"]
    )


# The stubs -------------------------------------------------------------------------------

STUBBED = {
    "vllm.config.parallel": ["ParallelConfig"],
    "vllm.v1.worker.gpu_worker": ["Worker"],
    "vllm.platforms.cuda": ["CudaPlatformBase", "CudaPlatform"],
}


def test_a_stub_keeps_what_the_attribute_and_function_checks_read(tmp_path, source_host_032):
    """Written from the installed 0.32 tree, the stubs answer as the sources do."""
    from scripts.vllm_api_stubs import main

    assert main(["--source", str(installed_vllm_tree()), "--out", str(tmp_path), *STUBBED]) == 0
    stubs = SourceHost(tmp_path, partial=True)
    for module, names in STUBBED.items():
        info = source_host_032.tree.module(module)
        for name in names:
            ref = source_host_032.lookup(module, name).ref
            assert stubs.lookup(module, name).ref == ref  # CudaPlatform: an alias of a class
            full, cut = source_host_032.attributes(ref), stubs.attributes(ref)
            assert cut.names == full.names and cut.class_names == full.class_names, ref
            assert cut.dynamic == full.dynamic  # (bases the cut leaves out are open in it)
            assert {k: ast_text(v) for k, v in cut.fields.items()} == {
                k: ast_text(v) for k, v in full.fields.items()
            }
        for function in info.functions:
            assert stubs.function(module, function) == source_host_032.function(module, function)
    assert "self.model_runner = _" in (tmp_path / "vllm/v1/worker/gpu_worker.py").read_text()


def ast_text(node) -> str | None:
    import ast

    return None if node is None else ast.unparse(node)


def test_a_stub_written_without_attributes_leaves_its_classes_unchecked(tmp_path):
    """An older cut (no attributes kept) must not read as classes without attributes."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm/__init__.py").write_text("")
    (tmp_path / "vllm/_version.py").write_text("__version__ = '0.0.1'\n")
    body = "class Base:\n    def __init__(self):\n        ...\n"
    (tmp_path / "vllm/old.py").write_text(f"{STUB_MARK} vllm/old.py\n{body}")
    (tmp_path / "vllm/new.py").write_text(f"{STUB_MARK} vllm/new.py\n{ATTRIBUTES_MARK} -\n{body}")
    host = SourceHost(tmp_path, partial=True)
    assert host.attributes(ClassRef("vllm.old", "Base")) is None
    assert host.attributes(ClassRef("vllm.new", "Base")).names == {"__init__"}
