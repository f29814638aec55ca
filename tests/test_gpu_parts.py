"""scripts/gpu_parts.sh: re-cut wheel parts to one `run` call's size, one folder a part,
the last folder carrying what the install needs beside its part."""

import hashlib
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_parts.sh"


def _cut(path: Path, name: str, data: bytes, size: int) -> None:
    for k in range(0, len(data), size):
        (path / f"{name}.part.{k // size:02d}").write_bytes(data[k : k + size])


def test_parts_are_recut_to_the_size_and_the_last_folder_holds_the_install(tmp_path):
    small, big = bytes(range(256)) * 10, bytes(reversed(range(256))) * 13
    (tmp_path / "parts").mkdir()
    _cut(tmp_path / "parts", "small.tar", small, 2000)
    _cut(tmp_path / "parts", "big-1.0-py3-none-any.whl", big, 3000)
    (tmp_path / "SHA256SUMS").write_text("stale\n")
    (tmp_path / "install.sh").write_text("echo install\n")

    out = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "1k"], capture_output=True, text=True, check=True
    ).stdout

    parts = sorted((tmp_path / "parts").iterdir())
    assert all(p.stat().st_size <= 1024 for p in parts)
    joined = {
        name: b"".join(p.read_bytes() for p in parts if p.name.startswith(name + ".part."))
        for name in ("small.tar", "big-1.0-py3-none-any.whl")
    }
    assert joined == {"small.tar": small, "big-1.0-py3-none-any.whl": big}
    folders = sorted(tmp_path.glob("p[0-9][0-9]"))
    assert len(folders) == len(parts) == 3 + 4  # 2,560 and 3,328 bytes in 1 KiB parts
    assert folders[0].joinpath("small.tar.part.00").exists()  # small.tar first, as installed
    last = folders[-1]
    assert sorted(p.name for p in last.iterdir() if ".part." not in p.name) == [
        "SHA256SUMS",
        "install.sh",
    ]
    sums = dict(line.split()[::-1] for line in (last / "SHA256SUMS").read_text().splitlines())
    assert sums == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in parts}
    assert f"{last.name} also holds SHA256SUMS install.sh" in out
