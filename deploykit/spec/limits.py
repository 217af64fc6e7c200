"""How many devices a deployment may name: the manifest's schema and ``--devices`` share these bounds.

Far above any real deployment, low enough that nothing built from them (a device list, a plan's table, a
placement group) can exhaust the host. Plain constants: importing them costs nothing.
"""

from __future__ import annotations

MAX_GPUS = 4096  # GPUs in a plan or an inventory, all nodes together; and tensor-parallel ranks
MAX_NODES = 1024  # machines: pipeline stages, nodes of a --devices spec
MAX_REPLICAS = 1024
