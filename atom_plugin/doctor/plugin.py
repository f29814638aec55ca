"""Hook implementations for the vendor GPU tools that `atom-plugin doctor` runs.

The order is the order `--smi auto` tries them: rocm-smi first (ATOM's CI
tables come from it), amd-smi where that is the one installed, then nvidia-smi.
"""

from atom_plugin.doctor.amd_smi import AmdSmiProbe
from atom_plugin.doctor.nvidia_smi import NvidiaSmiProbe
from atom_plugin.doctor.rocm_smi import RocmSmiProbe
from atom_plugin.hookspecs import hookimpl
from atom_plugin.specs import HealthProbeSpec


@hookimpl
def atom_health_probes() -> list[HealthProbeSpec]:
    return [
        HealthProbeSpec(smi="rocm", probe=RocmSmiProbe()),
        HealthProbeSpec(smi="amd", probe=AmdSmiProbe()),
        HealthProbeSpec(smi="nvidia", probe=NvidiaSmiProbe()),
    ]
