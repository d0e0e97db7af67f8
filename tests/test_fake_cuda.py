"""The cuda backend runs in CI: a pytest run on the strict fake libcuda (tests/fake_cuda) of every
test marked driver (the allocator tests' "cuda" cases) or fake_cuda (tests/test_cuda_driver_contract.py,
tests/test_fake_libcuda.py), selected by marker from the whole tests/ folder.

Without a GPU, no line of csrc/driver/cuda_driver.cpp ran before this; the fake checks each call
against the driver's contract and vmalloc's own rules, in forked children too (they report
through $FAKECUDA_REPORT).
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import fake_cuda
from vmalloc import Allocator

ROOT = Path(__file__).resolve().parent.parent


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
    junit = report.parent / "junit.xml"
    # cwd tests/: `python -m` puts the cwd first on sys.path, and the checkout's root there would
    # shadow an installed vmalloc (CI) with sources that have no built extension
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "driver or fake_cuda",
           f"--junitxml={junit}", str(ROOT / "tests")]
    proc = subprocess.Popen(cmd, cwd=ROOT / "tests", env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=900)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"pytest on the fake libcuda ran past 900 s:\n{out[-8000:]}")
    assert proc.returncode == 0, f"pytest on the fake libcuda failed ({' '.join(cmd)}):\n{out[-8000:]}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, out[-3000:])
    assert counts["tests"] >= 40, f"too few tests ran on the fake ({counts}):\n{out[-3000:]}"
    # the run's own process checks each test's violations (tests/conftest.py); what forked
    # children recorded only the report shows
    lines = report.read_text().splitlines() if report.exists() else []
    children = [ln for ln in lines if not ln.startswith(f"pid {proc.pid}: ")]
    assert children == [], "driver contract violations in forked children:\n" + "\n".join(children)
