"""Layer 7: desired against actual. The reconciler (decide, then act), the state store, rollouts,
the generation pool, the watcher and the ``Deployment`` facade. Never imports torch at module import."""
