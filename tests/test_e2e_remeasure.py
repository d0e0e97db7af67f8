"""bench/e2e_remeasure.py puts jobs measured again in one later call in place of their rows
of a results file and says so in its meta (rows, command, why, the earlier throughputs), the
README shows it, and ``bench/e2e.py --resume`` keeps that note for the rows it keeps."""
import json

import pytest

from bench import e2e, e2e_remeasure as rm
from bench.readme_format import Ctx
from bench.readme_runtime import e2e as readme_e2e

GPU = "Fake GPU"


def row(method, throughput, batch=64, model="resnet50", status="ok"):
    return {"model": model, "method": method, "batch_size": batch, "throughput": throughput,
            "unit": "images/s", "peak_bytes": 1 << 30, "budget_bytes": 16 << 30,
            "status": status, "note": "loss bitwise equal to plain training (8 steps)"}


def doc(rows, command="python bench/e2e.py --quick", gpu=GPU, steps=5, **meta):
    return {"meta": {"gpu": gpu, "driver": "1", "torch": "2", "date": "2026-11-28",
                     "command": command, "grid": {"budget": 16 << 30, "steps": steps,
                                                  "methods": ["native", "window"]}, **meta},
            "results": rows}


def test_rows_are_replaced_and_the_replacement_said(tmp_path):
    old = doc([row("native", 1700.0), row("window", 1100.04), row("rotor", 1600.0)])
    new = doc([row("native", 1709.0), row("window", 1706.0), row("lms", 230.0)],
              command="python bench/e2e.py --quick --methods native,window,lms --out /root/x.json")
    out = rm.merge(old, new, "window changed")
    got = {r["method"]: r["throughput"] for r in out["results"]}
    assert got == {"native": 1709.0, "window": 1706.0, "rotor": 1600.0, "lms": 230.0}
    (entry,) = out["meta"]["remeasured"]
    assert entry["rows"] == ["resnet50 native b64", "resnet50 window b64", "resnet50 lms b64"]
    assert entry["earlier_throughput"] == {"resnet50 native b64": 1700.0,
                                           "resnet50 window b64": 1100.0}
    assert entry["command"].endswith("--out FILE") and entry["why"] == "window changed"
    # a second one is added after the first; a dict (one session's hand-written entry) too
    again = rm.merge({**out, "meta": {**out["meta"], "remeasured": entry}}, new, "twice")
    assert [e["why"] for e in again["meta"]["remeasured"]] == ["window changed", "twice"]


@pytest.mark.parametrize("other, says", [({"gpu": "Other GPU"}, "GPU 'Other GPU'"),
                                         ({"steps": 10}, "steps 10")])
def test_rows_of_another_gpu_or_step_count_are_refused(other, says):
    with pytest.raises(ValueError, match=says):
        rm.merge(doc([row("native", 1.0)]), doc([row("native", 2.0)], **other), "x")
    with pytest.raises(ValueError, match="no rows"):
        rm.merge(doc([row("native", 1.0)]), doc([]), "x")


def test_the_command_line_rewrites_the_file_and_the_readme_shows_it(tmp_path, capsys):
    path, new = tmp_path / "e2e-Fake-quick.json", tmp_path / "new.json"
    path.write_text(json.dumps(doc([row("native", 1700.0), row("window", 1100.0)])))
    new.write_text(json.dumps(doc([row("window", 1706.0)])))
    assert rm.main([str(path), str(new), "--why", "kept in place"]) == 0
    d = json.loads(path.read_text())
    assert [r["throughput"] for r in d["results"]] == [1700.0, 1706.0]
    text = "\n".join(readme_e2e(Ctx(str(tmp_path), str(tmp_path)), d, path.name))
    assert "Re-measured on 2026-11-28" in text and "resnet50 window b64" in text
    assert "Why: kept in place." in text and "Before: resnet50 window b64 1100." in text
    with pytest.raises(SystemExit, match="cannot read"):
        rm.main([str(path), str(tmp_path / "missing.json"), "--why", "x"])


def test_resume_keeps_the_note_for_the_rows_it_keeps():
    meta = {"remeasured": [{"rows": ["resnet50 native b64", "resnet50 window b64"], "why": "a"},
                           {"rows": ["gpt2-s1024 rotor b8"], "why": "b"}]}
    kept = [e2e.JobResult.of_row(row("native", 1.0))]
    assert rm.carried(meta, kept) == [{"rows": ["resnet50 native b64"], "why": "a"}]
    assert rm.carried(None, kept) == [] and rm.carried({}, kept) == []


def test_e2e_resume_writes_the_kept_note(tmp_path):
    """A --resume run's file keeps meta.remeasured for its kept rows (the H100 file lost it)."""
    out = tmp_path / "e2e.json"
    argv = ["--smoke", "--models", "gpt2-s32", "--methods", "native", "--steps", "1",
            "--out", str(out)]
    assert e2e.main(argv) == 0
    d = json.loads(out.read_text())
    (r,) = d["results"]
    d["meta"]["remeasured"] = [{"rows": [rm.label(r)], "why": "kept"}]
    out.write_text(json.dumps(d))
    assert e2e.main(argv[:-2] + ["--resume", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["remeasured"] == [
        {"rows": [rm.label(r)], "why": "kept"}]
