"""Names in the installed vLLM's source, read as text: the CUDA kernels' modules do not
import without a GPU build, but their signatures are what the benchmarks must call."""

import ast
import importlib.util
import pathlib

import pytest


def vllm_parameters(module_path: str, name: str) -> set[str]:
    """The parameter names of function `name` in `module_path` (under the installed
    `vllm` package); skips the test where vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM not installed")
    src = pathlib.Path(spec.origin).parent / module_path
    fn = next(
        n for n in ast.walk(ast.parse(src.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == name
    )  # fmt: skip
    args = fn.args
    return {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
