"""benchmarks/mha_prefill_eager.py without a GPU: its flags."""

import pytest

from benchmarks import mha_prefill_eager


@pytest.mark.parametrize("text", ["1k", "0,512", "", "1024,-1"])
def test_bad_prompt_lengths_are_named(text, capsys):
    with pytest.raises(SystemExit) as stop:
        mha_prefill_eager.main(["--prompts", text])
    assert stop.value.code == 2
    assert f"--prompts {text!r}" in capsys.readouterr().err


def test_good_prompts_reach_the_gpu_check(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        mha_prefill_eager.main(["--prompts", "1024,512"])
