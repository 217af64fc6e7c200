"""The OpenAI-compatible API: one module per endpoint (models, chat, completions, embeddings), the
shapes in ``protocol``, what they share in ``common`` and ``generation``."""
