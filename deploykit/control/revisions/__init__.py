"""Revisions: what a deployment should be and what was recorded. The pure decision (``decide``), the
apply that observes, decides and acts (``reconciler``), one change checked and planned once (``change``),
a deployment's files (``layouts``), loading a revision (``loading``), the state store (``state``), what
``status`` and ``history`` show of the records (``report``), ``diff`` and ``lifecycle`` (rollback, delete).
Knows nothing of live deployments or the budget."""
