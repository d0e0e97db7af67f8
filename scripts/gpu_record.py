"""What scripts/gpu-check leaves for the repository: which GPU steps of issue 12 are done
(bench/results/gpu-progress.json) and how `pytest -m gpu` went (bench/results/gpu-tests.json).

A GPU session has 15 minutes of device time, so issue 12 takes several sessions: each one
commits this record, and the next one's `scripts/gpu-check --next` starts where it stopped.
A bench step recorded ok stays done (its numbers are committed); the test steps (pytest-gpu,
demo) are done only for the source they ran, named by a hash of it: the device machine gets a
copy of the working tree without git, so the hash is of the files, not of a commit. Two hashes:
``source`` over everything a step runs (bench/ and scripts/ too: a fix there retries a failed
bench), ``test_source`` over what the tests and the demo exercise only (a bench fix must not
cost the next session their 200+ s again).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

PROGRESS = Path("bench") / "results" / "gpu-progress.json"
GPU_TESTS = Path("bench") / "results" / "gpu-tests.json"
# what the steps run: a change here retries a step that failed (``source``)
SOURCE_DIRS = ("bench", "csrc", "scheduler", "tests", "vmalloc")
# scripts too: a step's command line or the build lives there (a fix there retries a failure)
SOURCE_FILES = ("CMakeLists.txt", "pyproject.toml", "scripts/gpu-check", "scripts/dev-build",
                "scripts/gpu_record.py")
# what the GPU tests and the demo exercise: a change here makes them stale (``test_source``)
# (bench/models: the model zoo a GPU test profiles; scripts/dev-build: the build's flags)
TEST_SOURCE_DIRS = ("csrc", "scheduler", "tests", "vmalloc", "bench/models")
TEST_SOURCE_FILES = ("CMakeLists.txt", "pyproject.toml", "scripts/dev-build")
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".txt", ".toml", ".cmake")
RERUN_ON_CHANGE = ("pytest-gpu", "demo")   # correctness checks: done only for the same source


def _source_files(root: Path, dirs: Sequence[str] = SOURCE_DIRS,
                  files: Sequence[str] = SOURCE_FILES) -> Iterator[Path]:
    for name in files:
        if (root / name).is_file():
            yield root / name
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(root / top):
            # build output and caches are not source (and differ between the two machines)
            dirnames[:] = sorted(d for d in dirnames
                                 if not d.startswith((".", "build")) and d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(SOURCE_SUFFIXES):
                    yield Path(dirpath) / f


def source_hash(root: Path, dirs: Sequence[str] = SOURCE_DIRS,
                files: Sequence[str] = SOURCE_FILES) -> str:
    """sha256 (first 16 hex digits) over the source files' paths and contents."""
    h = hashlib.sha256()
    for path in _source_files(root, dirs, files):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def source_hashes(root: Path) -> Dict[str, str]:
    """Both hashes, as a step record keeps them: ``source`` (all a step runs) and
    ``test_source`` (what the GPU tests and the demo exercise)."""
    return {"source": source_hash(root),
            "test_source": source_hash(root, TEST_SOURCE_DIRS, TEST_SOURCE_FILES)}


def source_key(step: str) -> str:
    """Which hash says whether ``step`` ran on the source at hand: the tests and the demo
    follow only what they exercise, the benches everything (bench/ and scripts/ included)."""
    return "test_source" if step in RERUN_ON_CHANGE else "source"


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


def _same_source(rec: Dict[str, Any], step: str, source: Union[str, Mapping[str, str]]) -> bool:
    """``source``: the hash for ``step`` (``source_key``), or both hashes (``source_hashes``)."""
    key = source_key(step)
    want = source if isinstance(source, str) else source[key]
    return rec.get(key) == want


def is_done(progress: Dict[str, Any], step: str, source: Union[str, Mapping[str, str]]) -> bool:
    rec = progress["steps"].get(step)
    if not rec or rec.get("status") != "ok":
        return False
    return step not in RERUN_ON_CHANGE or _same_source(rec, step, source)


def failed_for(progress: Dict[str, Any], step: str,
               source: Union[str, Mapping[str, str]]) -> bool:
    """The step exited with an error (not for time) on this very source (for the tests and
    the demo: what they exercise): running it again would only fail again."""
    rec = progress["steps"].get(step)
    return bool(rec) and rec.get("status") == "failed" and _same_source(rec, step, source)


def record(progress: Dict[str, Any], step: str, status: str, seconds: float,
           meta: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> None:
    """One step's outcome (ok, partial, errors, failed, timeout) replaces its last record;
    ``extra``: what the outcome rests on (a provisional decision's inputs, rows unavailable)."""
    progress["steps"][step] = {"status": status, "seconds": round(seconds, 1), **meta,
                               **(extra or {})}


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
    """Write ``doc`` whole or not at all: to a temporary file beside ``path``, then renamed over
    it. gpu-check is killed at its time limits; written in place, a kill mid-write left an
    empty record, and every later gpu-check stopped on it ("is not JSON"). (What
    vmalloc.atomic_file.write_atomic does, inline: gpu-check has only scripts/ on its path, so
    ``import vmalloc`` there would fail, or find an installed copy, not the checkout's.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1) + "\n"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):   # the write's own error is the one to see
            tmp.unlink()
        raise
