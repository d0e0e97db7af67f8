"""Environment for tests that start a fresh Python: it must import the same vmalloc and
scheduler as this test process (the installed package in CI, a checkout with a dev build
otherwise), never the unbuilt sources of the working directory. Run such subprocesses with a
``cwd`` outside the checkout: ``python -c`` puts the working directory first on ``sys.path``."""
import os
from typing import Dict

import vmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))


def python_env(*extra_path: str, base: Dict[str, str] = None, **variables: str) -> Dict[str, str]:
    """``base`` (default ``os.environ``) plus ``variables``, with ``PYTHONPATH`` = ``extra_path``,
    then where this process found vmalloc, then the checkout (for ``bench/`` only)."""
    env = dict(os.environ if base is None else base)
    env.update(variables)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*extra_path, PACKAGES, ROOT]))
    return env
