"""deploykit: declarative, YAML-driven deployments of large language models.

Importing the package is cheap (no torch, no transformers); heavy modules load when used.
"""

from .errors import (
    ApplyError,
    CheckpointError,
    DeploykitError,
    InventoryError,
    Issue,
    ManifestError,
    PlanInfeasible,
)

__version__ = "0.1.0"

__all__ = [
    "ApplyError", "CheckpointError", "DeploykitError", "InventoryError", "Issue", "ManifestError",
    "PlanInfeasible", "__version__",
]
