"""bench/hf.py --quick runs (CI smoke) and writes a results file readme_results can render."""
import json
import subprocess
import sys

from _subproc import ROOT, python_env


def test_quick_run_writes_rows_for_every_method(tmp_path):
    r = subprocess.run([sys.executable, f"{ROOT}/bench/hf.py", "--quick", "--models", "gpt2",
                        "--out", str(tmp_path)], env=python_env(), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.load(open(tmp_path / "hf-cpu.json"))
    rows = d["models"][0]["rows"]
    assert {r["method"] for r in rows} == {"plain", "hf-ckpt", "rotor", "pofo", "mimose"}
    plain, hf = rows[0], rows[1]
    assert 0 < hf["peak"] < plain["peak"]  # checkpointing every layer holds less
    for k in ("machine", "gpu", "torch", "date", "transformers"):
        assert d["meta"][k]
    sys.path.insert(0, f"{ROOT}/bench")
    import readme_results
    text = readme_results.render(str(tmp_path), str(tmp_path))
    assert "Hugging Face models" in text and "could not read" not in text.lower()
