"""Layer 2: what a checkpoint is, read without reading tensor data: safetensors headers, the checkpoint
directory and its fingerprint, and the model's structure (blocks, sizes, tied groups) from config.json."""
