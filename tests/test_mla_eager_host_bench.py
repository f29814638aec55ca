"""benchmarks/mla_eager_host.py: its arguments, and on a GPU the lines it prints."""

import pytest
import torch

from benchmarks import mla_eager_host


def test_bad_rows_and_context_are_named(capsys):
    with pytest.raises(SystemExit):
        mla_eager_host.main(["--rows", "64,x"])
    assert "--rows '64,x' --context 1024: rows >= 1, context >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mla_eager_host.main(["--context", "-1"])


def test_bad_decode_batches_are_named(capsys):
    with pytest.raises(SystemExit):
        mla_eager_host.main(["--decode-batches", "0,64"])
    assert "--decode-batches '0,64': a comma list of counts >= 1" in capsys.readouterr().err


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        mla_eager_host.main(["--rows", "8"])


@pytest.mark.gpu
def test_the_plan_is_timed_both_ways_beside_the_decode_and_the_write():
    lines, decode, host_plan = mla_eager_host._lines(16, 256)
    text = "\n".join(lines)
    assert " decode host " in text and " write  host " in text
    assert " plan, device search host " in text and " plan, host offsets  host " in text
    decode()
    assert host_plan().token_req.shape == (16,)


@pytest.mark.gpu
def test_a_decode_steps_plan_is_timed_both_ways():
    lines = mla_eager_host._decode_step_lines(8, 256)
    assert lines[0].startswith("decode step 8x1 over 256: plan, views of identity and seq_lens")
    assert lines[1].startswith("decode step 8x1 over 256: plan, arange and copy into buffers")
    assert lines[2].startswith("decode step 8x1 over 256: plan, views, for a graph replay")
    assert all(" host " in line for line in lines)
