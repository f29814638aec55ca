"""Hook implementation for the two-batch-overlap micro-batch runner."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import MicroBatchRunnerSpec


@hookimpl
def atom_microbatch_runner() -> MicroBatchRunnerSpec | None:
    return None
