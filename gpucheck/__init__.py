"""deploykit's GPU check: one prepared command that runs deploykit's GPU paths on a real GPU (and, without
one, a dry run of every step that needs none) and writes one report. See docs/gpu.md.

This package imports nothing beyond the standard library at import time: the runner starts each check in
its own process, and only the checks import torch, transformers and deploykit.
"""
