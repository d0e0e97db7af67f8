"""What scripts/gpu-check leaves for the repository: which GPU steps of issue 12 are done
(bench/results/gpu-progress.json) and how `pytest -m gpu` went (bench/results/gpu-tests.json).

A GPU session has 15 minutes of device time, so issue 12 takes several sessions: each one
commits this record, and the next one's `scripts/gpu-check --next` starts where it stopped.
A bench step recorded ok stays done (its numbers are committed); the test steps (pytest-gpu,
demo) are done only for the source they ran, named by a hash of it: the device machine gets a
copy of the working tree without git, so the hash is of the files, not of a commit.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

PROGRESS = Path("bench") / "results" / "gpu-progress.json"
GPU_TESTS = Path("bench") / "results" / "gpu-tests.json"
# what the tests exercise; a change here makes the GPU tests stale
SOURCE_DIRS = ("bench", "csrc", "scheduler", "tests", "vmalloc")
# scripts too: a step's command line or the build lives there (a fix there retries a failure)
SOURCE_FILES = ("CMakeLists.txt", "pyproject.toml", "scripts/gpu-check", "scripts/dev-build",
                "scripts/gpu_record.py")
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".txt", ".toml", ".cmake")
RERUN_ON_CHANGE = ("pytest-gpu", "demo")   # correctness checks: done only for the same source


def _source_files(root: Path) -> Iterator[Path]:
    for name in SOURCE_FILES:
        if (root / name).is_file():
            yield root / name
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            # build output and caches are not source (and differ between the two machines)
            dirnames[:] = sorted(d for d in dirnames
                                 if not d.startswith((".", "build")) and d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(SOURCE_SUFFIXES):
                    yield Path(dirpath) / f


def source_hash(root: Path) -> str:
    """sha256 (first 16 hex digits) over the source files' paths and contents."""
    h = hashlib.sha256()
    for path in _source_files(root):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def load_progress(root: Path) -> Dict[str, Any]:
    """The committed record, or an empty one. A file that does not parse is an error: writing
    over it would lose what earlier sessions did."""
    path = root / PROGRESS
    if not path.exists():
        return {"steps": {}}
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise SystemExit(f"gpu-check: {path} is not JSON ({exc}); fix or remove it") from exc
    steps = doc.get("steps") if isinstance(doc, dict) else None
    if not isinstance(steps, dict) or not all(isinstance(r, dict) for r in steps.values()):
        raise SystemExit(f"gpu-check: {path} has no 'steps' object of step records; fix or "
                         "remove it")
    return doc


def is_done(progress: Dict[str, Any], step: str, source: str) -> bool:
    rec = progress["steps"].get(step)
    if not rec or rec.get("status") != "ok":
        return False
    return step not in RERUN_ON_CHANGE or rec.get("source") == source


def failed_for(progress: Dict[str, Any], step: str, source: str) -> bool:
    """The step exited with an error (not for time) on this very source: running it again
    would only fail again."""
    rec = progress["steps"].get(step)
    return bool(rec) and rec.get("status") == "failed" and rec.get("source") == source


def record(progress: Dict[str, Any], step: str, status: str, seconds: float,
           meta: Dict[str, Any]) -> None:
    """One step's outcome (ok, failed, timeout) replaces its last record."""
    progress["steps"][step] = {"status": status, "seconds": round(seconds, 1), **meta}


# a line of `pytest -v`: "tests/test_x.py::test_y[a b] PASSED   [ 40%]"
VERBOSE_LINE = re.compile(r"^(tests/\S+?\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def junit_summary(xml_path: Path, meta: Dict[str, Any],
                  log_path: Optional[Path] = None) -> Dict[str, Any]:
    """pytest's junit XML as gpu-tests.json: per test its outcome, seconds and the first lines
    of a failure, so a committed record says which test failed where and how long each took
    (the next session sizes its device call from these). Without a readable XML (pytest killed
    at its time limit, or crashed) the outcomes its ``-v`` log shows up to where it stopped,
    marked incomplete: never the last run's record left in place."""
    tests: List[Dict[str, Any]] = []
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError) as exc:
        return from_verbose_log(log_path, meta, f"{type(exc).__name__}: {exc}")
    for case in root.iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (el.get("message") or "") + "\n" + (el.text or "")
                message = "\n".join(text.strip().splitlines()[:12])[:1500]
                break
        tests.append({"test": f"{module}.py::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2),
                      **({"message": message} if message else {})})
    return {"meta": meta, "summary": summarize(tests), "tests": tests}


def summarize(tests: List[Dict[str, Any]]) -> Dict[str, Any]:
    counts: Dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {**counts, "total": len(tests),
            "seconds": round(sum(t["seconds"] for t in tests), 1)}


def from_verbose_log(log_path: Optional[Path], meta: Dict[str, Any], why: str) -> Dict[str, Any]:
    """What a pytest run that wrote no junit XML showed in its -v log (no durations)."""
    outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
               "XFAIL": "skipped", "XPASS": "passed"}
    tests: List[Dict[str, Any]] = []
    try:
        lines = log_path.read_text(errors="replace").splitlines() if log_path else []
    except OSError:
        lines = []
    for line in lines:
        m = VERBOSE_LINE.match(line)
        if m:
            tests.append({"test": m.group(1), "outcome": outcome[m.group(2)], "seconds": 0.0})
    return {"meta": meta, "summary": summarize(tests), "complete": False,
            "note": f"no junit XML from pytest ({why}): killed at its time limit or crashed; "
                    f"{len(tests)} outcomes from its -v log, up to where it stopped "
                    "(logs/pytest-gpu.log in logs.tar.gz)", "tests": tests}


def write_json(path: Path, doc: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")

