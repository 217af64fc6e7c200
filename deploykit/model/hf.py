"""The two things every module that touches transformers needs: the model class for a task, and
transformers' own logging kept out of deploykit's output. Imports transformers only when called."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("deploykit")

# transformers builds models through process-wide state (init patches, the tying of weights): two
# threads building models of one tied-embedding checkpoint at once made one of them report
# 'lm_head.weight' missing. Every model construction in this process (meta or real) holds this lock.
BUILD_LOCK = threading.RLock()


def auto_class(task: str) -> Any:
    """The transformers Auto class that builds a model for ``task``."""
    import transformers

    return {
        "causal-lm": transformers.AutoModelForCausalLM,
        "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
        "feature-extraction": transformers.AutoModel,
    }[task]


@contextlib.contextmanager
def quiet_transformers(*, progress: bool = False) -> Iterator[None]:
    """transformers' advice and warnings off (deploykit reports what matters itself; -vv shows them),
    and its loading progress bar only where a person watches (``progress``)."""
    import transformers

    previous = transformers.logging.get_verbosity()
    if not log.isEnabledFor(logging.DEBUG):
        transformers.logging.set_verbosity_error()
    if not progress:
        transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)
        if not progress:
            transformers.logging.enable_progress_bar()


def preload() -> None:
    """Import transformers and its Auto classes now, on one thread. Its lazy module is not safe to
    initialise from several threads at once ("cannot import name 'AutoConfig'"), which parallel
    loads would otherwise do."""
    import transformers

    for name in ("AutoConfig", "AutoTokenizer", "AutoModel", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM"):
        getattr(transformers, name)
