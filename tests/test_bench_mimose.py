"""bench/mimose.py --quick runs every method (CI smoke: a renamed attribute of the wrapped
chain once broke only the full benchmark's input-aware row)."""
import json
import subprocess
import sys

from _subproc import ROOT, python_env


def test_quick_run_writes_every_method(tmp_path):
    r = subprocess.run([sys.executable, f"{ROOT}/bench/mimose.py", "--quick",
                        "--out", str(tmp_path / "mimose.json")], env=python_env(), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.load(open(tmp_path / "mimose.json"))
    methods = {run["method"] for run in d["runs"]}
    assert {"static", "mimose", "rotor-ia"} <= methods, methods
    ia = [run for run in d["runs"] if run["method"] == "rotor-ia"]
    assert all("chain_source" in run for run in ia)
    # the tags every results file carries (bench.common.run_meta), the bench's own keys kept
    meta = d["meta"]
    assert all(meta.get(k) for k in ("machine", "gpu", "torch", "date")), sorted(meta)
    assert (meta["gpu"] == "cpu") == (meta["device"] == "cpu") and meta["bench"] == "mimose"
