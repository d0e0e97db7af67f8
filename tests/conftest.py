import os
import sys

import pytest

# bench/ (the model zoo, bundled chains and traces) is not installed: append the checkout so
# tests can import it, while an installed vmalloc/scheduler still comes first on sys.path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
