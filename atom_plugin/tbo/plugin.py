"""Hook implementation for the two-batch-overlap micro-batch runner."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import MicroBatchRunnerSpec
from atom_plugin.tbo.runner import MicroBatchRunner

RUNNER_NAME = "atom_tbo"


@hookimpl
def atom_microbatch_runner() -> MicroBatchRunnerSpec:
    """`factory(device=..., timeout_s=...)` builds a `MicroBatchRunner`."""
    return MicroBatchRunnerSpec(name=RUNNER_NAME, factory=MicroBatchRunner)
