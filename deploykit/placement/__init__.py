"""Layer 3: where things go. The inventory (the only hardware probe, or a simulated one) and the pure,
exact planner (``planner``, over ``partition``, ``capacity``, ``host`` and ``nodes``) that turns a
structure, a spec and an inventory into a ``Plan`` (``plan``)."""
