"""A serving-engine simulator that shows the canary catching KV-cache corruption end to end.

``python -m kvcanary_cupy demo`` runs it; :func:`run` is the same from Python.
"""

from .engine import LAYOUTS, Engine, SimConfig
from .faults import BATCH_FAULTS, FAULT_CLASSES, STATE_FAULTS, FaultInjector
from .runner import Progress, SimResult, run

__all__ = ["BATCH_FAULTS", "Engine", "FAULT_CLASSES", "FaultInjector", "LAYOUTS", "Progress", "STATE_FAULTS",
           "SimConfig", "SimResult", "run"]
