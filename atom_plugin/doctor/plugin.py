"""Hook implementations for the vendor GPU tools that `atom-plugin doctor` runs."""

from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import HealthProbeSpec


@hookimpl
def atom_health_probes() -> list[HealthProbeSpec]:
    return []
