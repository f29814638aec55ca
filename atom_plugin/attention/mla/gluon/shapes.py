"""The Gluon MLA decode kernels' tiles, warps and stages, which the launch plan and the
probe read on the host. Gluon-free: importing this (or the plan, or the probe) never
imports `triton.experimental.gluon`; only the launcher (`gluon_launch.run_stage1`) imports
the kernels (`lockstep`, `alternate`, `scorer`, `rows16`), at their first launch.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_M = 64  # query rows per program: one warpgroup MMA's M
BLOCK_N = 64  # keys per tile

# The lockstep schedule (`lockstep`)
NUM_WARPS = 8  # two warpgroups
STAGES = 2  # tiles in flight: 2 x 72 KB beside the 72 KB query fill the shared memory

# The alternate schedule (`alternate`); the scorer schedule (`scorer`) launches alike, its
# scoring warpgroup the default partition, its multiplying one in the second consumer's place
CHUNK_COLS = 64  # columns of one TMA box: a 512 + 64 row arrives in nine
ALTERNATE_NUM_WARPS = 4  # the kernel's own warps: consumer warpgroup 0 (the default partition)
# With consumer warpgroup 1 and the loader warp the kernel runs 12 warps (warps are
# granted by warpgroups): 168 registers a thread at launch fill the SM's 64K, and the
# partitions then take 240 (each consumer) and 24 (the loader).
ALTERNATE_MAXNREG = 168

# The 16-row fp8 kernel (`rows16`): one query token of 16 heads on four warps
ROWS16_BLOCK_M = 16  # query rows per program: mma.sync's M
ROWS16_BLOCK_N = 32  # keys per TMA tile
ROWS16_NUM_WARPS = 4
ROWS16_STAGES = 5  # 5 x 18 KB of fp8 tiles beside the query and the output pass: two programs an SM


@dataclass(frozen=True)
class GluonShape:
    """What a schedule fixes of its launch: query rows and keys a program holds, its warps,
    its pipeline stages and the programs an SM runs at once."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int
    per_sm: int


def launch_shape(schedule: str) -> GluonShape:
    """The launch shape of a Gluon schedule ('lockstep', 'alternate', 'scorer', 'rows16')."""
    if schedule == "rows16":
        return GluonShape(ROWS16_BLOCK_M, ROWS16_BLOCK_N, ROWS16_NUM_WARPS, ROWS16_STAGES, 2)
    return GluonShape(BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, 1)
