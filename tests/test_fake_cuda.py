"""The cuda backend runs in CI: a pytest run on the strict fake libcuda (tests/fake_cuda) of every
test marked driver (the allocator tests' "cuda" cases) or fake_cuda (tests/test_cuda_driver_contract.py).

Without a GPU, no line of csrc/driver/cuda_driver.cpp ran before this; the fake checks each call
against the driver's contract and vmalloc's own rules, in forked children too (they report
through $FAKECUDA_REPORT).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fake_cuda
from vmalloc import Allocator

ROOT = Path(__file__).resolve().parent.parent
# where the driver-marked tests live (a new one elsewhere must be added here)
FILES = ["tests/test_allocator.py", "tests/test_allocator_state.py", "tests/test_cuda_driver_contract.py"]


def cuda_backend_compiled() -> bool:
    try:
        Allocator("cuda")
    except RuntimeError as exc:
        return "compiled without cuda.h" not in str(exc)
    return True  # a real driver is present


def needs(what: str, ok: bool) -> None:
    """Skip without `what` on a developer's machine; in CI (where both must be present) fail."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the cuda backend on the fake libcuda, but {what}")
    pytest.skip(what)


def test_cuda_backend_on_the_fake_driver(tmp_path_factory):
    needs("this vmalloc was built without cuda.h (the cuda backend is compiled out)",
          cuda_backend_compiled())
    needs("no C compiler to build the fake libcuda", fake_cuda.compiler() is not None)
    lib_dir = fake_cuda.build(tmp_path_factory.mktemp("fake_libcuda"))
    report = tmp_path_factory.mktemp("fake_report") / "violations.txt"
    env = dict(os.environ)
    env.update({
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH")) if p),
        fake_cuda.ENV_FLAG: "1",
        "FAKECUDA_REPORT": str(report),
    })
    # cwd tests/: `python -m` puts the cwd first on sys.path, and the checkout's root there would
    # shadow an installed vmalloc (CI) with sources that have no built extension
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "driver or fake_cuda",
           "-rs", *(str(ROOT / f) for f in FILES)]
    done = subprocess.run(cmd, cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"pytest on the fake libcuda failed ({' '.join(cmd)}):\n{out[-8000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 30, f"too few tests ran on the fake:\n{out[-3000:]}"
    assert "skipped" not in out.splitlines()[-1], f"a driver test skipped on the fake:\n{out[-3000:]}"
    violations = report.read_text() if report.exists() else ""
    assert violations == "", f"driver contract violations (forked children included):\n{violations}"
