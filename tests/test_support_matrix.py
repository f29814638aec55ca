"""The support matrix has one source (`atom_plugin.vllm.compat.support`): the README shows
it as it is, and it names every release of the supported range."""

from __future__ import annotations

from pathlib import Path

from atom_plugin.cli import main
from atom_plugin.vllm import compat
from atom_plugin.vllm.compat.support import CAPABILITIES, SUPPORT, matrix_markdown

README = Path(__file__).resolve().parent.parent / "README.md"
START = "<!-- support matrix: atom_plugin/vllm/compat/support.py -->\n"
END = "\n<!-- end of support matrix -->"


def test_readme_shows_the_matrix_as_its_source_has_it():
    text = README.read_text()
    assert START in text and END in text
    shown = text.split(START, 1)[1].split(END, 1)[0]
    assert shown == matrix_markdown()


def test_matrix_covers_the_supported_range_and_every_capability():
    releases = [tuple(int(p) for p in r.split(".")) for r in SUPPORT]
    low, below = compat.SUPPORTED_VLLM_MIN, compat.SUPPORTED_VLLM_BELOW
    assert releases == [(0, minor) for minor in range(low[1], below[1])]
    assert all(len(cells) == len(CAPABILITIES) for cells in SUPPORT.values())


def test_info_prints_the_matrix(capsys):
    assert main(["info", "--support"]) == 0
    out = capsys.readouterr().out
    assert f"supported vLLM releases: {compat.SUPPORTED_VLLM}" in out
    assert matrix_markdown() in out
