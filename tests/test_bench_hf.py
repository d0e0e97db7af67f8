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
    assert {r["method"] for r in rows} == {"plain", "hf-ckpt", "every-block", "rotor", "pofo",
                                        "mimose"}
    plain, hf = rows[0], rows[1]
    assert 0 < hf["peak"] < plain["peak"]  # checkpointing every layer holds less
    for k in ("machine", "gpu", "torch", "date", "transformers"):
        assert d["meta"][k]
    sys.path.insert(0, f"{ROOT}/bench")
    import readme_results
    text = readme_results.render(str(tmp_path), str(tmp_path))
    assert "Hugging Face models" in text and "could not read" not in text.lower()


def test_goal_check_reads_rotor_rows_against_hf_checkpointing():
    sys.path.insert(0, f"{ROOT}/bench")
    import hf
    rows = [{"method": "plain", "budget": None, "status": "ok", "step_s": 1.0, "peak": 100},
            {"method": "hf-ckpt", "budget": None, "status": "ok", "step_s": 1.4, "peak": 30},
            {"method": "rotor", "budget": 24, "status": "ok", "step_s": 1.5, "peak": 24},
            {"method": "rotor", "budget": 30, "status": "ok", "step_s": 1.3, "peak": 29},
            {"method": "rotor", "budget": 60, "status": "ok", "step_s": 1.1, "peak": 58}]
    assert hf.goal_check(rows) == {"faster_at_hf_peak": True, "less_memory_at_hf_time": True,
                                   "below_hf_peak": True}
    rows[3].update(step_s=1.45)
    assert hf.goal_check(rows)["faster_at_hf_peak"] is False
    # a win inside the timing noise is not a win: rotor's median must beat HF's least
    rows[3].update(step_s=1.3, step_s_median=1.42)
    assert hf.goal_check(rows)["faster_at_hf_peak"] is False
    # ... and so is one that runs as many forwards as HF's plan
    rows[3].update(step_s_median=1.3, forwards=13)
    every = {"method": "every-block", "budget": 30, "status": "ok", "step_s": 1.4, "peak": 30,
             "forwards": 13}
    assert hf.goal_check(rows + [every])["faster_at_hf_peak"] is False
    rows[3].update(forwards=12)
    assert hf.goal_check(rows + [every])["faster_at_hf_peak"] is True
    # "at HF's step time": rotor's least step within HF's median
    rows[2].update(step_s=1.45)
    rows[3].update(step_s=1.45)
    assert hf.goal_check(rows)["less_memory_at_hf_time"] is False
    rows[1].update(step_s_median=1.5)
    assert hf.goal_check(rows)["less_memory_at_hf_time"] is True
    skipped = [r for r in rows if r["method"] != "rotor"]
    assert set(hf.goal_check(skipped).values()) == {None}


def test_classifier_gets_one_label_per_sequence():
    import torch
    import transformers as T
    sys.path.insert(0, f"{ROOT}/bench")
    import hf
    ids = torch.randint(1, 100, (3, 8))
    cls = T.BertForSequenceClassification(T.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=100, max_position_embeddings=8, num_labels=hf.CLASSES))
    labels = hf.labels_for(cls, ids)
    assert labels.shape == (3,) and int(labels.max()) < hf.CLASSES
    assert cls(input_ids=ids, labels=labels).loss.dim() == 0
    lm = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100,
                                        n_positions=8))
    assert hf.labels_for(lm, ids) is ids


def test_resume_keeps_only_models_measured_with_the_outputs_watched(tmp_path):
    """A results file from before the tail's outputs were watched (its plans counted the
    logits through the tail's backward) is measured again, not resumed."""
    sys.path.insert(0, f"{ROOT}/bench")
    import hf
    meta = {"device_tag": "cpu", "quick": False, "steps": 7, "tail_outputs": hf.TAIL_OUTPUTS}
    model = {"model": "gpt2", "rows": [{"method": "plain", "status": "ok"}]}
    path = tmp_path / "hf-cpu.json"
    path.write_text(json.dumps({"meta": meta, "models": [model]}))
    assert list(hf.resumed(str(path), meta)) == ["gpt2"]
    path.write_text(json.dumps({"meta": {k: v for k, v in meta.items() if k != "tail_outputs"},
                                "models": [model]}))
    assert hf.resumed(str(path), meta) == {}
