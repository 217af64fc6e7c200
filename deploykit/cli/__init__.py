"""The ``deploykit`` command: one module per verb, each a thin layer over the library. This package is
the only place that prints to the terminal and maps errors to exit codes (0 ok, 2 invalid manifest,
1 anything else); the rules (prune, rollback choice, reconcile) live in ``deploykit.control``.

Heavy imports (torch, transformers) happen only inside the verbs that need them, so ``validate``,
``schema`` and a warm ``plan`` start in a fraction of a second.
"""

from __future__ import annotations

import logging

import click

from .. import __version__
from .apply import apply
from .delete import delete
from .diff import diff
from .golden import golden
from .plan import plan
from .reshard import reshard, verify
from .rollback import rollback
from .rollout import rollout
from .schema import schema
from .serve import serve
from .sources import sources
from .status import history, status
from .validate import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deploykit")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Declarative deployments of large language models: validate, plan, apply, serve."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


for _verb in (validate, plan, reshard, verify, apply, diff, status, history, rollback, rollout, golden, delete,
              serve, schema, sources):
    main.add_command(_verb)

__all__ = ["main"]
