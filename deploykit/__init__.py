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


def __getattr__(name: str) -> object:
    if name == "Deployment":  # imported on first use: it pulls in the manifest schema
        from .control.live.deployment import Deployment

        return Deployment
    raise AttributeError(f"module 'deploykit' has no attribute {name!r}")


__all__ = [
    "ApplyError", "CheckpointError", "Deployment", "DeploykitError", "InventoryError", "Issue", "ManifestError",
    "PlanInfeasible", "__version__",
]
