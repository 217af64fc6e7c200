"""Layer 1: the manifest. Schema (pydantic), YAML with positions, located errors, JSON Schema and the
Markdown reference. Never imports torch or anything above it."""
