"""`pytest --pyargs atom_plugin.conformance`: one test per registered implementation.

`ATOM_PLUGIN_CONFORMANCE_PLUGIN=NAME` limits it to one plugin (as `--plugin NAME`).
"""

from __future__ import annotations

import os

import pytest

from atom_plugin.conformance import PLUGIN_ENV, checks

CHECKS = checks(plugin=os.environ.get(PLUGIN_ENV) or None)


@pytest.mark.parametrize("check", CHECKS, ids=[c.implementation for c in CHECKS])
def test_implementation_meets_its_contract(check):
    findings = list(check.run())
    failures = [f for f in findings if not f.ok]
    assert findings, f"{check.implementation}: no contract item was checked"
    assert not failures, "\n".join(map(str, failures))
