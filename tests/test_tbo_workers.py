"""The TBO workers' modules: a GPU engine's worker must leave `torch.cuda` as torch made it.

vLLM's CPU worker module (`vllm.v1.worker.cpu.shm`, imported by `cpu_worker`)
replaces `torch.cuda.Event`, `torch.cuda.current_stream` and friends with CPU
placeholders for the whole process. When the GPU worker shared a module with the
CPU one, a TBO engine on the H200 failed in inductor's autotuning ("expected
stream to be a torch.Stream or torch.cuda.Stream object").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atom_plugin.vllm.compat.runners import has_v1_runner
from atom_plugin.vllm.tbo.setup import TBO_WORKERS

pytestmark = pytest.mark.vllm

PROBE = """
import importlib, json, sys
import torch
event = torch.cuda.Event
module, _, name = sys.argv[1].rpartition(".")
worker = getattr(importlib.import_module(module), name)
print(json.dumps({
    "worker": worker.__name__,
    "cpu_shm_imported": "vllm.v1.worker.cpu.shm" in sys.modules,
    "torch_cuda_event_kept": torch.cuda.Event is event,
}))
"""


def _import_in_fresh_process(class_path: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, class_path], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("runner", "name"), [("v1", "AtomTboGPUWorker"), ("mrv2", "AtomTboMRV2Worker")]
)
def test_gpu_tbo_worker_leaves_torch_cuda_alone(runner, name):
    if runner == "v1" and not has_v1_runner():
        pytest.skip("this vLLM has no V1 model runner")
    assert TBO_WORKERS[("cuda", runner)] == TBO_WORKERS[("rocm", runner)]
    facts = _import_in_fresh_process(TBO_WORKERS[("cuda", runner)])
    assert facts == {
        "worker": name,
        "cpu_shm_imported": False,
        "torch_cuda_event_kept": True,
    }


def test_cpu_tbo_worker_takes_vllms_cpu_placeholders():
    """The probe sees the patch where it happens (so the GPU test above can fail)."""
    facts = _import_in_fresh_process(TBO_WORKERS[("cpu", "v1")])
    assert facts == {
        "worker": "AtomTboCPUWorker",
        "cpu_shm_imported": True,
        "torch_cuda_event_kept": False,
    }
