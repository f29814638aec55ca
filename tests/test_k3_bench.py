"""The K3 benchmark's schema-constrained calls table (benchmarks/k3_logits.py): a CPU smoke run.

The smoke run goes through every path the H200 run takes (the mixed batch with calls through
`ChannelCore.apply`, its mask checked against the state machine and against xgrammar's
bitmask apply, xgrammar's host fill for vLLM's own kimi_k3 tag, the token-class build),
interpreted, at a small synthetic vocabulary. Its timings are not checked.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from benchmarks import k3_logits
from benchmarks.k3_calls import BATCH, FREE_ROWS, CallsBatch, XgrammarFill
from benchmarks.k3_vocab import SyntheticK3Tokenizer


def test_calls_smoke_run_masks_the_mixed_batch_in_one_launch():
    table = k3_logits.run(k3_logits.parse_args(["--smoke", "--calls-only"]))
    rows = [line for line in table.splitlines() if line.startswith("| mixed batch 256 with calls")]
    assert len(rows) == 1, table
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1:4] == ["256", "38", "1 / n/a (cpu)"]
    assert re.fullmatch(r"\d+", cells[7]), cells  # xgrammar's apply ran
    assert re.fullmatch(r"\d+ \(192 rows, [\d.]+/row\)", cells[8]), cells  # and its host fill
    assert "122 masked rows" in table and "5 channels" in table
    assert re.search(r"synthetic vocabulary of 4096 ids .*: [\d.]+ s on the host CPU", table)
    assert "Required and named channels" not in table  # --calls-only


def test_each_row_kind_is_in_the_state_it_names():
    tokenizer = SyntheticK3Tokenizer(4096)
    batch = CallsBatch(tokenizer, torch.device("cpu"))
    kinds = {}
    for row in batch.rows:
        if row.channel:
            channel = batch.channels[row.channel]
            kinds[row.what] = (
                "forced"
                if channel.forced_token(row.state) is not None
                else "waiting"
                if channel.is_waiting(row.state)
                else "masked"
                if channel.is_masked(row.state)
                else "other"
            )
    for what, kind in kinds.items():
        expected = "forced" if what.startswith(("forced", "named: forced")) else "masked"
        assert kind == ("waiting" if what == "waiting" else expected), what
    assert sum(1 for r in batch.rows if not r.channel) == FREE_ROWS == 64
    # xgrammar accepted every row's ids under vLLM's tag, and the bitmask gives our mask.
    fill = XgrammarFill(batch)
    assert fill.rows == BATCH - FREE_ROWS
    import xgrammar

    logits = torch.zeros(BATCH, len(tokenizer))
    xgrammar.apply_token_bitmask_inplace(logits, batch.bitmask(len(tokenizer), "cpu"))
    assert np.array_equal(torch.isfinite(logits).numpy(), batch.allowed(len(tokenizer)))
    assert not batch.allowed(len(tokenizer))[: BATCH - FREE_ROWS].all(axis=1).any()
