"""Gluon (`triton.experimental.gluon`) exists only in newer Tritons: the MLA modules, the
launch plan, the Gluon probe and `atom-plugin info` never import it on a machine without a
GPU; only the launcher imports the Gluon kernels, at their first launch. Checked in a fresh
interpreter, so nothing an earlier test imported counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import contextlib, io, json, sys

import torch

from atom_plugin.attention.mla import launch_plan, ops, plan, triton  # noqa: F401
from atom_plugin.attention.mla.gluon.probe import MLAStepLayout, gluon_mla_problems
from atom_plugin.cli import main

layout = MLAStepLayout(torch.bfloat16, 64)
problems = gluon_mla_problems() + gluon_mla_problems(torch.device("cpu"), layout)
launch = launch_plan.plan_launch(32, 32, 1, 128, 4096, torch.device("cpu"), layout=layout)
with contextlib.redirect_stdout(io.StringIO()) as info:
    main(["info"])


KERNEL_MODULES = ("common", "lockstep", "alternate", "scorer", "launch")  # those that import Gluon


def gluon_modules():
    return sorted(
        m
        for m in sys.modules
        if m.startswith("triton.experimental.gluon")
        or m in {f"atom_plugin.attention.mla.gluon.{k}" for k in KERNEL_MODULES}
    )


before = gluon_modules()
try:  # the launcher's import: where this Triton has Gluon, it loads Gluon
    from atom_plugin.attention.mla.gluon import launch as gluon_launch  # noqa: F401
except ImportError:
    launched = None
else:
    launched = gluon_modules()
print(json.dumps(dict(problems=problems, kernel=launch.kernel, info=info.getvalue(),
                      before=before, launched=launched)))
"""


def test_plan_probe_and_info_do_not_import_gluon():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["problems"] == ["no CUDA GPU", "device cpu (the Gluon kernel runs on CUDA GPUs)"]
    assert got["kernel"] == "per_token"
    assert "hopper MLA decode (Gluon): no (no CUDA GPU)" in got["info"]
    assert got["before"] == [], "imported before any Gluon launch"
    if got["launched"] is not None:  # the check sees Gluon once the launcher loads it
        assert "triton.experimental.gluon" in got["launched"]
        assert "atom_plugin.attention.mla.gluon.lockstep" in got["launched"]
