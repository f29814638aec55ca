import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined: without a GPU every
# test module must see it before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def installed_vllm_tree():
    """The folder holding the installed `vllm` package."""
    from pathlib import Path

    import vllm

    return Path(vllm.__file__).parent.parent


@pytest.fixture(scope="module")
def installed_host():
    """The installed vLLM, imported and inspected by the host-API checks."""
    from atom_plugin.vllm.compat.hosts import InstalledHost

    return InstalledHost()


@pytest.fixture(scope="module")
def source_host_032():
    """The installed vLLM 0.32 tree, read as source by the host-API checks."""
    from atom_plugin.vllm.compat.hosts import SourceHost

    return SourceHost(installed_vllm_tree())


@pytest.fixture(scope="session")
def engine_faults(tmp_path_factory):
    """`engine_faults(miscut=..., rerun_graphs=...)`: the environment that puts these faults
    into every vLLM process a test starts (`tbo_harness.fault_plugin`)."""
    from tests.tbo_harness.fault_plugin import fault_plugin_env

    def env(**faults) -> dict[str, str]:
        return fault_plugin_env(tmp_path_factory.mktemp("engine-faults"), **faults)

    return env


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random-weight Llama (head size 64, GQA 2:1) built locally once per session."""
    from scripts.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """A tiny random-weight Mixtral (4 experts, top 2, head size 64) built locally once."""
    from tests.models.tiny_moe import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    """A tiny DeepSeek-V2-style MLA model (latent 512 + 64) built locally once."""
    from tests.models.tiny_deepseek import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(scope="module")
def k3_channel_live():
    """The K3 channel live in this process, as the platform records it for an engine with
    the processor installed: for parser tests that start no engine."""
    from atom_plugin.vllm.k3 import enforcement as k3_enforcement

    live = k3_enforcement.ChannelDecision(
        off=None, processor="atom_plugin.vllm.k3.logits_v1:AtomK3LogitsProcessorV1", runner="v1"
    )
    before = k3_enforcement.record(live)
    yield live
    k3_enforcement.record(before)


@pytest.fixture
def k3_channel_off():
    """The K3 channel off in this process, as the platform records it for the V1 runner
    with speculative decoding."""
    from atom_plugin.vllm.k3 import enforcement as k3_enforcement

    off = k3_enforcement.ChannelDecision(
        off="its logits processor is off: the V1 model runner refuses custom logits "
        "processors with speculative decoding",
        fix="drop --speculative-config",
    )
    before = k3_enforcement.record(off)
    yield off
    k3_enforcement.record(before)


@pytest.fixture
def nan_partials(monkeypatch):
    """Stage 1's partial buffers start as NaN (as unfilled memory may hold); the buffers
    of each call are kept."""
    made = []

    def partials(T, H, splits, kv_lora_rank, device):
        mid_o = torch.full((T, H, splits, kv_lora_rank), float("nan"), device=device)
        mid_lse = torch.full((T, H, splits), float("nan"), device=device)
        made.append((mid_o, mid_lse))
        return mid_o, mid_lse

    from atom_plugin.attention.mla import triton as mla_triton

    monkeypatch.setattr(mla_triton, "split_partials", partials)
    return made


@pytest.fixture
def triton_version(monkeypatch):
    """Sets the Triton version the MLA launch plan reads (`launch_plan._triton_version`)."""
    from atom_plugin.attention.mla import launch_plan

    def use(version: tuple[int, int]) -> None:
        monkeypatch.setattr(launch_plan, "_triton_version", lambda: version)

    return use
