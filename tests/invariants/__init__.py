"""The model-based test of deploykit (docs/testing.md): random sequences of manifest writes, control-API calls,
traffic and faults driven through a real deploykit, with its invariants checked after every step.

``world``: the tiny real models, adapters and broken copies every sequence draws from, their manifests and their
reference answers. ``checks``: the invariants that need no deploykit (files, threads, processes).
``library`` and ``server``: the two tiers (the in-process ``Deployment``, a real ``deploykit serve``).
``config``: how many examples and which seeds run, and ``KNOWN_OPEN``, the operations left out while their
defect is open."""
