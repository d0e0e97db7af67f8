"""Where ``python bench/<name>.py`` finds ``vmalloc``, ``scheduler`` and ``bench`` when run
from a checkout: the checkout first on ``sys.path`` when its C++ core is built there
(``scripts/dev-build``), else last, so that an installed build (``pip install .``, as the
README sets up) serves them rather than the checkout's sources failing with
"vmalloc._core is not built"."""
import importlib.machinery
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def built_here() -> bool:
    """The checkout has its own ``vmalloc._core`` for this interpreter."""
    return any(os.path.exists(os.path.join(ROOT, "vmalloc", "_core" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def on_path() -> None:
    if ROOT in sys.path:
        return
    if built_here() or importlib.util.find_spec("vmalloc") is None:
        sys.path.insert(0, ROOT)
    else:
        sys.path.append(ROOT)
