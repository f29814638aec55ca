"""Host-API conformance: the adapter against the installed vLLM (imported and inspected),
against vLLM source trees read with ast (the installed 0.32 tree, a signature-only cut of
0.33.0: tests/fixtures/vllm_0_33_api), and throwaway adapters with planted faults."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from atom_plugin.vllm import compat
from atom_plugin.vllm.compat.check import Adapter, Coverage, check
from atom_plugin.vllm.compat.hosts import SourceHost

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_033 = ROOT / "tests" / "fixtures" / "vllm_0_33_api"
# installed_host, source_host_032: tests/conftest.py


def throwaway(
    tmp_path: Path, package: str, source: str, module: str = "planted"
) -> tuple[Adapter, str]:
    """An adapter package of one module holding `source`, and that module's file path as
    the check's findings name it."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / f"{module}.py").write_text(source)
    return Adapter(tmp_path, package), f"{package}/{module}.py"


# The overrides the adapter depends on, and the rest of its host-facing methods.
EXPECTED_OVERRIDES = {
    "AtomAiterBackend.get_name",
    "AtomAiterBackend.get_supported_kernel_block_sizes",
    "AtomAiterMetadataBuilder.build",
    "AtomAiterMetadataBuilder.build_for_cudagraph_capture",
    "AtomAiterImpl.do_kv_cache_update",
    "AtomAiterImpl.forward",
    "AtomAiterMLAMetadataBuilder.build",
    "AtomAiterMLAMetadataBuilder._build_decode",
    "AtomAiterMLAImpl.forward_mqa",
    "AtomAiterMLAImpl.do_kv_cache_update",
    "AtomCpuPlatform.get_attn_backend_cls",
    "AtomCpuPlatform.check_and_update_config",
    "AtomCudaPlatform.get_attn_backend_cls",
    "AtomRocmPlatform.check_and_update_config",
    "AtomK3LogitsProcessorV1.apply",
    "AtomK3LogitsProcessorV1.update_state",
    "AtomK3LogitsProcessorV1.validate_params",
    "AtomK3LogitsProcessorMRV2.add_request",
    "AtomK3LogitsProcessorMRV2.apply",
    "AtomKimiK3ToolParser.adjust_request",
    "AtomKimiK3ToolParser.extract_tool_calls",
    "AtomKimiK3ToolParser.extract_tool_calls_streaming",
    # two-batch overlap on Model Runner V2
    "AtomTboMRV2Worker._make_model_runner",
    "AtomTboMRV2ModelRunner.execute_model",
    "AtomTboMRV2ModelRunner.gather_batch_req_state",
    "AtomTboMRV2ModelRunner.initialize_kv_cache",
    "TboUBatchRunner.prepare",
    "TboUBatchRunner.run",
    "TboCudaGraphManager.capture",
    "TboCudaGraphManager.dispatch",
    "TboCudaGraphManager.run_fullgraph",
}


def test_adapter_conforms_to_the_installed_vllm(installed_host):
    coverage = Coverage()
    problems = check(installed_host, Adapter(ROOT), coverage)
    assert problems == [], "\n".join(map(str, problems))
    missing = EXPECTED_OVERRIDES - set(coverage.overrides)
    assert not missing, f"not compared: {sorted(missing)}"
    assert coverage.call_sites > 0 and coverage.imports > 20
    # the config and `self` reads and the calls of vLLM functions were compared as well
    assert coverage.attribute_reads > 100 and coverage.function_calls > 10, coverage
    assert coverage.skipped == []  # 0.32 has the V1 runner: its modules are checked too


def test_adapter_conforms_to_the_installed_tree_read_statically(source_host_032):
    assert source_host_032.version() == installed_host_version()
    problems = check(source_host_032, Adapter(ROOT))
    assert problems == [], "\n".join(map(str, problems))


def installed_host_version() -> str:
    import vllm

    return vllm.__version__


PLANTED = textwrap.dedent(
    """
    import torch
    from vllm.v1.attention.backend import MLAAttentionImpl, NoSuchHostName


    class PlantedMLAImpl(MLAAttentionImpl):
        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            return q, None

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping):
            pass  # the host passes kv_cache_dtype and k_scale too


    class DerivedImpl(PlantedMLAImpl):
        def forward_mqa(self, q, kv_c_and_k_pe_cache):  # attn_metadata, layer dropped
            return q, None
    """
)


@pytest.mark.parametrize("which", ["installed", "source"])
def test_planted_mismatch_and_missing_import_are_named(
    tmp_path, which, installed_host, source_host_032
):
    host = installed_host if which == "installed" else source_host_032
    adapter, where = throwaway(tmp_path, "throwaway_adapter", PLANTED)
    problems = check(host, adapter)
    text = "\n".join(map(str, problems))
    imports = [p for p in problems if p.kind == "import"]
    assert len(imports) == 1, text
    assert imports[0].where == f"{where}:3"
    assert "NoSuchHostName from vllm.v1.attention.backend" in imports[0].detail
    sigs = {(p.where, p.kind) for p in problems if p.kind in ("signature", "call")}
    assert (f"{where}:10 PlantedMLAImpl.do_kv_cache_update", "signature") in sigs, text
    assert "'kv_cache_dtype' is missing" in text
    # vLLM's own call site (MLAAttention.update_kv_cache) is named too
    assert any(
        p.kind == "call" and "mla_attention.py" in p.detail and "do_kv_cache_update" in p.where
        for p in problems
    ), text
    # a subclass of an adapter class is checked against the host's base as well
    assert (f"{where}:15 DerivedImpl.forward_mqa", "signature") in sigs, text
    # nothing else: the correct override (forward_mqa of PlantedMLAImpl) passes
    assert not any("PlantedMLAImpl.forward_mqa" in p.where for p in problems), text


RUNNER = textwrap.dedent(
    """
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker


    class SplitModelRunner(GPUModelRunner):
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return super().execute_model(scheduler_output, intermediate_tensors)

        def _dummy_run(self, num_tokens, **kwargs):  # optional ones by keyword: fine
            return super()._dummy_run(num_tokens, **kwargs)


    class SplitWorker(Worker):
        def execute_model(self):  # scheduler_output dropped
            return None


    class RoutingMixin:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend):  # attn_selector_config dropped
            return None


    class RoutingPlatform(RoutingMixin, CpuPlatform):
        pass
    """
)


def test_a_worker_and_model_runner_added_to_the_package_are_checked(tmp_path, installed_host):
    """Nothing lists the classes: a new module's vLLM subclasses are found and checked."""
    adapter, _ = throwaway(tmp_path, "runner_adapter", RUNNER, module="tbo_worker")
    problems = check(installed_host, adapter)
    mixin = "runner_adapter/tbo_worker.py:22 RoutingMixin (in RoutingPlatform)"
    assert [(p.kind, p.where) for p in problems] == [
        ("signature", "runner_adapter/tbo_worker.py:16 SplitWorker.execute_model"),
        ("signature", f"{mixin}.get_attn_backend_cls"),
        ("call", f"{mixin}.get_attn_backend_cls"),
    ], problems
    assert "'scheduler_output' is missing" in problems[0].detail
    assert "'attn_selector_config' is missing" in problems[1].detail
    assert "selector.py" in problems[2].detail  # vLLM's current_platform call


UNDECLARED = textwrap.dedent(
    """
    from vllm.v1.attention.backend import AttentionImpl


    class KvImpl(AttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                     sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                     attn_type="decoder", kv_sharing_target_layer_name=None):
            pass

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            return output

        def do_kv_cache_update(self, layer, key, value):  # kv_cache, slot_mapping dropped
            pass
    """
)


def test_a_hook_vllm_calls_without_declaring_it_is_checked_at_its_call_sites(
    tmp_path, installed_host
):
    """vLLM 0.32's AttentionImpl declares no do_kv_cache_update; the layers call it."""
    adapter, _ = throwaway(tmp_path, "kv_adapter", UNDECLARED, module="impl")
    problems = check(installed_host, adapter)
    assert [(p.kind, p.where) for p in problems] == [
        ("call", "kv_adapter/impl.py:15 KvImpl.do_kv_cache_update")
    ], problems
    assert "attention.py" in problems[0].detail and "none of vLLM's" in problems[0].detail


def test_an_abstract_member_left_out_is_named(tmp_path, installed_host):
    source = (
        "from vllm.v1.attention.backend import MLAAttentionImpl\n\n"
        "class HalfImpl(MLAAttentionImpl):\n    pass\n"
    )
    adapter, _ = throwaway(tmp_path, "half_adapter", source, module="impl")
    problems = check(installed_host, adapter)
    assert {p.kind for p in problems} == {"abstract"}, problems
    assert all("half_adapter/impl.py:3 HalfImpl" == p.where for p in problems)
    missing = sorted(p.detail.split()[3] for p in problems)
    assert missing == ["__init__", "forward_mqa"], problems


def pre_fix_adapter(tmp_path: Path) -> Adapter:
    """This adapter as it was before the 0.33 fixes (the two changes undone)."""
    target = tmp_path / "atom_plugin" / "vllm"
    shutil.copytree(ROOT / "atom_plugin" / "vllm", target)
    undo = {
        "attention/mha.py": (
            "from vllm.v1.kv_cache_interface import is_quantized_kv_cache",
            "from vllm.utils.torch_utils import is_quantized_kv_cache",
        ),
        "attention/mla.py": ("        skip_scale: bool = False,\n", ""),
    }
    for name, (new, old) in undo.items():
        path = target / name
        text = path.read_text()
        assert text.count(new) == 1, f"{name} no longer holds {new!r}"
        path.write_text(text.replace(new, old))
    return Adapter(tmp_path)


def test_vllm_033_api_accepts_the_adapter():
    problems = check(SourceHost(FIXTURE_033, partial=True), Adapter(ROOT))
    assert problems == [], "\n".join(map(str, problems))


def test_vllm_033_api_names_both_breaks_of_the_code_before_the_fixes(tmp_path):
    host = SourceHost(FIXTURE_033, partial=True)
    assert host.version() == "0.33.0"
    problems = check(host, pre_fix_adapter(tmp_path))
    text = "\n".join(map(str, problems))
    kinds = {(p.kind, p.where.split(":")[0]) for p in problems}
    assert kinds == {
        ("import", "atom_plugin/vllm/attention/mha.py"),
        ("signature", "atom_plugin/vllm/attention/mla.py"),
        ("call", "atom_plugin/vllm/attention/mla.py"),
    }, text
    assert "is_quantized_kv_cache from vllm.utils.torch_utils" in text
    assert "'skip_scale' is missing" in text


def test_the_pre_fix_code_still_passes_on_032(tmp_path, source_host_032):
    """0.32 accepted both: the check is about the host, not about the adapter changing."""
    assert check(source_host_032, pre_fix_adapter(tmp_path)) == []


def test_static_command_line_imports_no_vllm():
    code = (
        "import sys, runpy; sys.argv = ['compat', '--source', sys.argv[1], '--partial']"
        "\ntry: runpy.run_module('atom_plugin.vllm.compat', run_name='__main__')"
        "\nexcept SystemExit as e: print('exit', e.code, 'vllm imported:', 'vllm' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURE_033)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("checking atom_plugin.vllm"), proc.stdout + proc.stderr
    assert "vLLM 0.33.0 sources" in lines[0]
    assert lines[-2].startswith("0 problem(s)")
    assert lines[-1] == "exit 0 vllm imported: False"


def test_command_line_reports_and_exits(tmp_path, capsys):
    from atom_plugin.vllm.compat.__main__ import main

    assert main(["--source", str(tmp_path / "nowhere.whl")]) == 2
    assert "no such source tree or wheel" in capsys.readouterr().err
    assert main(["--source", str(FIXTURE_033), "--partial", "--adapter", str(ROOT)]) == 0
    assert "0 problem(s)" in capsys.readouterr().out
    assert main(["--source", str(FIXTURE_033), "--adapter", str(tmp_path / "nothing")]) == 2
    assert "no such source tree or wheel" in capsys.readouterr().err


# The supported range -----------------------------------------------------------------


def test_supported_range_is_declared_once_and_pyproject_repeats_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm{compat.SUPPORTED_VLLM}"]
    assert compat.SUPPORTED_VLLM == ">=0.32,<0.35"
    assert all(compat.is_supported(v) for v in compat.CHECKED_RELEASES)


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.33.2+cpu", True),
        ("0.31.1", False),
        ("0.34.0", True),
        ("0.34.1", True),
        ("0.35.0", False),
        ("0.35.0rc1.dev12", False),
        ("1.0.0", False),
        ("dev", False),
    ],
)
def test_versions_inside_and_outside_the_range(version, supported):
    assert compat.is_supported(version) is supported
    message = compat.unsupported_message(version)
    assert (message is None) is supported
    if message:
        assert f"vLLM {version}" in message and ">=0.32,<0.35" in message


def test_start_up_warns_once_outside_the_range(monkeypatch):
    from atom_plugin.vllm import plugin

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.atom_plugin")
    logger.addHandler(handler)
    try:
        for version in ("0.35.0", "0.32.0"):
            monkeypatch.setattr(plugin, "running_vllm", lambda v=version: v)
            plugin._announce.__wrapped__(("ATOM_AITER",))
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "this is vLLM 0.35.0" in warnings[0] and ">=0.32,<0.35" in warnings[0]


# skip_scale (vLLM 0.33's seventh argument) ----------------------------------------------


def test_mla_cache_write_honours_skip_scale():
    """skip_scale says the fp8 scale is 1: rows are written unscaled, whatever k_scale holds."""
    from atom_plugin.vllm.attention.mla import AtomAiterMLAImpl

    # The write's only impl state is the kernel path it resolves at its first call
    # (what __init__ leaves unset); vLLM's MLA constructor arguments are not needed.
    impl = AtomAiterMLAImpl.__new__(AtomAiterMLAImpl)
    impl._write_impl = None
    gen = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(3, 512, generator=gen), torch.randn(3, 1, 64, generator=gen)
    slots = torch.tensor([0, 5, -1])
    k_scale = torch.tensor(4.0)

    def write(**kwargs):
        cache = torch.zeros(2, 4, 576, dtype=torch.uint8)  # vLLM hands fp8 caches as bytes
        impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "fp8", k_scale, **kwargs)
        return cache.view(torch.float8_e4m3fn).float().view(-1, 576)

    scaled, unit = write(), write(skip_scale=True)
    rows = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    fp8 = lambda x: x.to(torch.float8_e4m3fn).float()
    assert torch.equal(unit[[0, 5]], fp8(rows[:2]))
    assert torch.equal(scaled[[0, 5]], fp8(rows[:2] / 4.0))
    assert not unit[[1, 2, 3, 4, 6, 7]].any()  # the negative slot wrote nothing
