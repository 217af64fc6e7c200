"""What freeing a generation hands back to the OS, and the leak guard that checks it did (``pool``)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("deploykit.control.live.pool")  # the pool's log, as before the move

LEAK_FLOOR = 16 << 20  # RSS growth below this is allocator noise, not a kept model (tiny models)


def report_reclaimed(name: str, number: int, *, rss: int, baseline: int, model_bytes: int) -> None:
    """Leak guard: after generation ``number`` is freed, RSS should be near the first generation's."""
    excess = rss - baseline
    if excess > max(1.5 * model_bytes, LEAK_FLOOR):
        log.warning("%s: memory not reclaimed after freeing generation %d: RSS %d MiB is %d MiB above "
                    "the first generation's (the model is %d MiB); is a model kept outside acquire()?",
                    name, number, rss >> 20, excess >> 20, model_bytes >> 20)
    else:
        log.info("generation %d of %s freed; RSS %d MiB", number, name, rss >> 20)


def return_memory() -> None:
    """Collect what the freed generation left (reference cycles), hand the heap back to the OS, and empty
    CUDA's caching allocator. Called once nothing references the model any more: tensors that die later
    go into the allocator's cache and stay there, out of reach of the next ``empty_cache``'s caller."""
    gc.collect()
    _trim_heap()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: its mmap threshold grows as large
    tensors are freed, and later ones come from the heap), so an unload lowers RSS, not only the
    allocator's free lists. A no-op where glibc is absent."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # pragma: no cover
        pass
