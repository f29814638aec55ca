"""Start `vllm serve` as a subprocess and wait until it answers (used by the demo and tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(**extra: str | None) -> dict[str, str]:
    """This process's environment for a vLLM process: a small CPU KV cache and no
    TRITON_INTERPRET (a test-only switch; vLLM must see the machine as it is), then
    `extra` (None removes a variable)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def vllm_command() -> list[str]:
    """vLLM's command line (`vllm`), through `scripts.vllm_cli` for the CPU build."""
    return [sys.executable, "-m", "scripts.vllm_cli"]


class VllmServer:
    """`vllm serve MODEL ARGS` on 127.0.0.1, its output in `log_path`."""

    def __init__(self, model: str | Path, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.log_path = Path(log_path)
        self.cmd = [
            *vllm_command(),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.env = vllm_env(**(env or {}))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0, progress: bool = False) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.proc.returncode}; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        if progress:
                            print(" ready", flush=True)
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if progress:
                print(".", end="", flush=True)
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vllm serve did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
