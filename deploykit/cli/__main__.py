"""``python -m deploykit.cli``: the same as the ``deploykit`` command."""

from . import main

main()
