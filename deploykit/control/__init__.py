"""Layer 7: desired against actual. The decision and the reconciler (decide, then act), the layouts
(a deployment's files), the state store, rollouts, the generation pool, the watcher and the
``Deployment`` facade. Never imports torch at module import."""
