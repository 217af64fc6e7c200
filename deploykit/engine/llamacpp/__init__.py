"""The llama.cpp engine: a llama-server process per generation (docs/engines.md)."""
