"""The bundled simulated traces (bench/traces/*.json.gz) are what the documented command makes
from today's chains: ``python bench/traces/make_traces.py`` is deterministic, so a remade chain
that changes a trace must come with the regenerated trace (and the results replayed from it).
Once they drifted silently (the chains were remade, the traces not): README's fragmentation
numbers could not be reproduced. No GPU needed; regenerating all of them takes about a second."""
import difflib
import glob
import gzip
import json
import os
import subprocess
import sys
from typing import Any, Dict, List

from _subproc import ROOT, python_env

TRACES = os.path.join(ROOT, "bench", "traces")
COMMAND = "python bench/traces/make_traces.py"   # README's and make_traces.py's documented one


def read(path: str) -> Dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def simulated(paths: List[str]) -> Dict[str, str]:
    """name -> path of the traces make_traces.py makes (not those recorded on a GPU)."""
    return {os.path.basename(p): p for p in paths if not read(p)["meta"].get("real_gpu_trace")}


def first_difference(bundled: Dict[str, Any], made: Dict[str, Any]) -> str:
    """Where two traces part: the meta lines that differ, else the first differing event."""
    if bundled["meta"] != made["meta"]:
        lines = difflib.unified_diff(
            json.dumps(bundled["meta"], indent=1, sort_keys=True).splitlines(),
            json.dumps(made["meta"], indent=1, sort_keys=True).splitlines(),
            "bundled meta", "regenerated meta", lineterm="", n=0)
        return "\n".join(lines)
    a, b = bundled["events"], made["events"]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"{len(a)} events bundled, {len(b)} regenerated; first difference at event {i}: "
            f"{a[i] if i < len(a) else None} vs {b[i] if i < len(b) else None}")


def test_the_bundled_traces_are_what_make_traces_makes(tmp_path):
    out = tmp_path / "traces"
    r = subprocess.run([sys.executable, os.path.join(TRACES, "make_traces.py"), "--out", str(out)],
                       env=python_env(), cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    made = simulated(glob.glob(str(out / "*.json.gz")))
    bundled = simulated(glob.glob(os.path.join(TRACES, "*.json.gz")))
    assert made, f"make_traces.py wrote no trace into {out}: {r.stdout}"
    assert sorted(bundled) == sorted(made), (
        f"bundled simulated traces {sorted(bundled)} but make_traces.py makes {sorted(made)}: "
        f"run `{COMMAND}`")
    for name in sorted(made):
        b, m = read(bundled[name]), read(made[name])
        assert b == m, (f"bench/traces/{name} is not what `{COMMAND}` makes from today's chains "
                        f"(regenerate it, then rerun bench/fragmentation.py and "
                        f"bench/cache_slack.py):\n{first_difference(b, m)}")
