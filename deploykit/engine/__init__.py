"""Layer 5: a loaded model generation: loading a plan onto its devices, the health check, and the work
a model does for requests. Knows nothing of manifests files or the state store."""
