"""The adapter's calls of vLLM's module-level functions: does each still bind?

A call counts when what it calls is a name bound to a vLLM function by an import of the
module or of the function around the call (`from vllm.v1.worker.gpu_worker import
_num_workspace_lanes` inside a method), or a dotted name through an imported vLLM module
(`gpu_worker._num_workspace_lanes(...)`). Its shape (positional count, keywords) is bound
against each definition of the function the host has (`signature.call_problems`); it is
reported when none takes it. Classes the adapter constructs are not checked here.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from atom_plugin.vllm.compat.hosts import is_host_module
from atom_plugin.vllm.compat.signature import CallShape, Sig, call_problems
from atom_plugin.vllm.compat.source import (
    ModuleInfo,
    binding_target,
    code_scopes,
    dotted_name,
    import_bindings,
)


@dataclass(frozen=True)
class FunctionCall:
    scope: str  # 'Class.method', 'function' or '' (module level)
    line: int
    written: str  # the callee as the adapter writes it
    target: str  # module.name in vLLM
    shape: CallShape
    sigs: tuple[Sig, ...]  # the host's definitions

    @property
    def problems(self) -> list[str]:
        """Why no definition takes the call (empty when one does)."""
        reasons = [call_problems(sig, self.shape) for sig in self.sigs]
        return [] if any(not r for r in reasons) else reasons[0]


def function_calls(
    host, tree: ast.Module, info: ModuleInfo, is_package: bool
) -> Iterator[FunctionCall]:
    """Every call in the module `tree` of a vLLM function the host shows."""
    for label, scope in code_scopes(tree):
        local = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Import | ast.ImportFrom):
                local.update(import_bindings(node, info.name, is_package))
        names = dataclasses.replace(info, bindings={**info.bindings, **local}) if local else info
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call) or isinstance(node.func, ast.Subscript):
                continue
            written = dotted_name(node.func)
            target = None if written is None else binding_target(names, written)
            if target is None or not is_host_module(target[0]):
                continue
            sigs = host.function(*target)
            if sigs:
                dotted = ".".join(target)
                yield FunctionCall(
                    label, node.lineno, written, dotted, CallShape.of(node), tuple(sigs)
                )
