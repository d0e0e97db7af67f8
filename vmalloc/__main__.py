"""``python -m vmalloc``: the ``vmalloc`` command (:func:`vmalloc.cli.main`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
