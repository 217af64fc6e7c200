"""Layer 4: files on disk laid out for a plan: streaming resharding, verification, atomic file steps.
Never loads a model."""
