"""Which cache column each register of the 16-row fp8 decode (`gluon.rows16`) holds: the
column orders that let it read whole 16-byte runs of an fp8 tile from shared memory.

`mma.sync` fixes which elements of an operand a thread holds: within each 16-wide step of
the contraction, lane t holds elements 2t, 2t+1, 2t+8 and 2t+9, a few bytes apart. A
contraction may run over its index in any order, as long as both operands agree, so the
kernel relabels the columns: the logical index the MMA sees maps to a physical cache
column such that a thread's registers cover consecutive bytes (one 16-byte load each) and
the eight threads of a load phase fall in different banks of the 128-byte swizzled tile.

- Scores (S = Q K^T over the 512 latent and 64 rope columns): the contraction is split
  between the four warps, warp w taking latent columns [128w, 128w + 128) and rope columns
  [16w, 16w + 16); within its block, logical index kk of the MMA reads column
  `latent_column(kk)` (`rope_column` for the rope part). Query and keys both go through it.
- Values (O += P V): the output column index is relabelled instead (the keys stay in
  order, P's), logical n holding physical column `value_column(n)`; the output is written
  back through the inverse.

Every map is a permutation of bits, hence linear over GF(2): applied to the bases of a
shared-memory layout it gives the layout of the relabelled view (`view_bases`), which the
kernel loads from. Gluon-free: the maps are tested on the CPU host. They are Triton
`constexpr_function`s, which the kernel may call while it compiles.
"""

from __future__ import annotations

from triton.runtime.jit import constexpr_function

WARPS = 4
LATENT = 512
ROPE = 64
LATENT_PER_WARP = LATENT // WARPS  # 128
ROPE_PER_WARP = ROPE // WARPS  # 16


@constexpr_function
def _bits(value: int, sources: tuple[int, ...]) -> int:
    """The integer whose bit i is bit sources[i] of value."""
    return sum(((value >> s) & 1) << i for i, s in enumerate(sources))


# Physical column bit i within a warp's block comes from logical bit _LATENT_FROM[i]:
# the five register bits of the B operand (k0, k3, k4, k5, k6) are the low, consecutive
# bytes; the two lane bits (k1, k2) pick the 32-byte run.
_LATENT_FROM = (0, 3, 4, 5, 6, 1, 2)
_ROPE_FROM = (0, 3, 1, 2)
# Values: physical column bit i comes from bit _VALUE_FROM[i] of n. n's register bits
# (5..8: the n8 tiles a warp holds) are 16 consecutive bytes, its lane bits (0..2) the
# 16-byte run of a 128-byte row, its warp bits (3, 4) the 128-column block.
_VALUE_FROM = (5, 6, 7, 8, 0, 1, 2, 3, 4)


@constexpr_function
def _inverse(sources: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(sources)
    for i, s in enumerate(sources):
        inv[s] = i
    return tuple(inv)


@constexpr_function
def latent_column(kk: int) -> int:
    """Physical column (within a warp's 128) of logical contraction index kk."""
    return _bits(kk, _LATENT_FROM)


@constexpr_function
def latent_index(col: int) -> int:
    """Logical contraction index of physical column col (within a warp's 128)."""
    return _bits(col, _inverse(_LATENT_FROM))


@constexpr_function
def rope_column(kk: int) -> int:
    return _bits(kk, _ROPE_FROM)


@constexpr_function
def rope_index(col: int) -> int:
    return _bits(col, _inverse(_ROPE_FROM))


@constexpr_function
def value_column(n: int) -> int:
    """Physical latent column that logical output column n holds."""
    return _bits(n, _VALUE_FROM)


@constexpr_function
def value_index(col: int) -> int:
    return _bits(col, _inverse(_VALUE_FROM))


@constexpr_function
def contraction_view(row: int, col: int, per_warp: int) -> list[int]:
    """(warp, logical index, row) of physical element (row, col) of a latent (per_warp 128)
    or rope (16) tile: the scores' view [warps, per_warp, rows]."""
    index = latent_index if per_warp == LATENT_PER_WARP else rope_index
    return [col // per_warp, index(col % per_warp), row]


@constexpr_function
def value_view(row: int, col: int) -> list[int]:
    """(row, logical output column) of physical element (row, col): the values' view."""
    return [row, value_index(col)]


@constexpr_function
def view_bases(offset_bases: list[list[int]], kind: str) -> list[list[int]]:
    """The offset bases of a relabelled view of a [rows, cols] shared-memory layout, given
    its own bases: kind 'latent' or 'rope' (the scores' view [warps, index, rows], keys or
    query rows), 'latent_rows' / 'rope_rows' (the same view, [warps, rows, index], for the
    query, the A operand) or 'value' ([rows, logical column])."""
    out = []
    for row, col in offset_bases:
        if kind == "value":
            out.append(value_view(row, col))
            continue
        per_warp = LATENT_PER_WARP if kind.startswith("latent") else ROPE_PER_WARP
        w, idx, r = contraction_view(row, col, per_warp)
        out.append([w, r, idx] if kind.endswith("_rows") else [w, idx, r])
    return out
