"""Layer 8: the HTTP face of deploykit: the supervisor of a manifest directory and the ops endpoints.
Never runs model code on an event loop and never touches SQLite directly."""
