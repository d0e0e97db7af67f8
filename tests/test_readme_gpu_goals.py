"""README's "Goals at a glance" from the e2e and swap results a GPU session brings back
(bench/readme_runtime.py, bench/readme_results.render): a goal is judged only on the grid it is
about, a full and complete one; until then its row says what ran and what is missing, and never
disappears. The files are shaped as `scripts/gpu-check` writes them: e2e-<GPU>-quick.json
(--quick), e2e-<GPU>-<model>.json (--full, one per model), e2e-<GPU>-coexist.json
(--coexist-only), swap.json's gpu key (--gpu-only, --quick in a first session)."""
import json

import pytest

from bench import readme_results as rr

TAG, GPU = "NVIDIA_H100_80GB_HBM3", "NVIDIA H100 80GB HBM3"
META = {"gpu": GPU, "driver": "580.65", "torch": "2.11.0+cu130", "date": "2026-11-27"}
COEXIST = [f"window+vmalloc (process {i} of 2, half budget)" for i in (1, 2)]


def row(model, batch, method="native", status="ok", throughput=100.0):
    return {"model": model, "method": method, "batch_size": batch, "throughput": throughput,
            "unit": "images/s", "peak_bytes": 1 << 30, "budget_bytes": 16 << 30,
            "status": status, "note": ""}


def write(res, name, obj):
    (res / name).write_text(json.dumps(obj))


def e2e_file(res, what, command, rows, **meta):
    write(res, f"e2e-{TAG}-{what}.json", {"meta": dict(META, command=command, **meta),
                                          "results": rows})


def goals(res, bench):
    """The goal rows of "Goals at a glance" whose benchmark cell starts with `bench`."""
    block = rr.render(str(res), str(res.parent.parent))
    glance = block.split("### Goals at a glance")[1].split("\n### ")[0]
    return [line for line in glance.splitlines() if line.startswith(f"| {bench}")]


@pytest.fixture
def res(tmp_path):
    d = tmp_path / "bench" / "results"
    d.mkdir(parents=True)
    return d


# ---------------------------------------------------------------------------- e2e (GPU)
def test_no_gpu_file_says_not_run_no_gpu_lent(res):
    e2e_file(res, "x", "python bench/e2e.py --smoke", [row("resnet50", 2)], gpu="cpu")
    got = goals(res, "e2e")
    assert len(got) == 1 and "| e2e (GPU) |" in got[0], got
    assert "not run: no GPU results (no GPU lent)" in got[0] and got[0].endswith("| n/a |")


def test_only_the_quick_file_keeps_a_not_run_yet_row(res):
    """After the first GPU session only e2e-<GPU>-quick.json is there: the goal row stays."""
    e2e_file(res, "quick", f"python bench/e2e.py --quick --resume bench/results/e2e-{TAG}-quick.json",
             [row("resnet50", 64), row("gpt2-s1024", 8)])
    got = goals(res, "e2e")
    assert len(got) == 1, got
    assert "| e2e (GPU) | ResNet-50 batch >= 2048 within 16 GiB, >= 60% of unconstrained " \
           "throughput at batch 1440 | not run yet (only --quick)" in got[0]
    assert got[0].endswith("| n/a |")
    # with the coexist pair and another model's full grid, still not run: what ran is said
    e2e_file(res, "coexist", "python bench/e2e.py --coexist-only --coexist 512 --resume x",
             [row("resnet50", 512, m) for m in COEXIST])
    e2e_file(res, "gpt2-s1024", "python bench/e2e.py --models gpt2-s1024 --resume x",
             [row("gpt2-s1024", 8)])
    got = goals(res, "e2e")
    assert len(got) == 1 and "not run yet (only --quick, --coexist-only, other models)" in got[0]
    # the full, complete ResNet-50 grid: its verdicts replace the row
    e2e_file(res, "resnet50", "python bench/e2e.py --models resnet50 --resume x",
             [row("resnet50", 64), row("resnet50", 1440, "window+vmalloc", throughput=70.0)])
    got = goals(res, "e2e")
    assert not [g for g in got if "| e2e (GPU) |" in g], got
    assert f"| e2e ({GPU}) | ResNet-50 batch >= 2048 within 16 GiB | batch 1440 " \
           "(window+vmalloc) | **no** |" in got
    assert f"| e2e ({GPU}) | >= 60% of unconstrained throughput at batch 1440 | 70.0% " \
           "(window+vmalloc) | yes |" in got


def test_the_coexist_pair_makes_no_goal_row(res):
    """--coexist-only's two processes at half the budget are not the grid the goal is about."""
    e2e_file(res, "coexist", "python bench/e2e.py --coexist-only --coexist 512 --resume x",
             [row("resnet50", 512, m) for m in COEXIST])
    got = goals(res, "e2e")
    assert not [g for g in got if "process 1 of 2" in g or "**no**" in g], got
    assert len(got) == 1 and "not run yet (only --coexist-only)" in got[0]
    # nor do coexist rows inside a full grid (--coexist 64 with the grid) count as its batch
    e2e_file(res, "resnet50", "python bench/e2e.py --models resnet50 --coexist 2048 --resume x",
             [row("resnet50", 64)] + [row("resnet50", 2048, m) for m in COEXIST])
    got = goals(res, "e2e")
    assert f"| e2e ({GPU}) | ResNet-50 batch >= 2048 within 16 GiB | batch 64 (native) | " \
           "**no** |" in got, got


@pytest.mark.parametrize("meta, rows, words", [
    ({"incomplete": True, "not_run": 30}, [row("resnet50", 64), row("resnet50", 128)],
     "2 of 32 jobs"),
    ({"incomplete": True}, [row("resnet50", 64)], "1 jobs so far"),   # killed mid-run
    ({}, [row("resnet50", 64), row("resnet50", 128, status="not_run")], "1 of 2 jobs"),
])
def test_an_incomplete_grid_is_not_judged(res, meta, rows, words):
    e2e_file(res, "resnet50", "python bench/e2e.py --models resnet50 --resume x", rows, **meta)
    got = goals(res, "e2e")
    assert len(got) == 2, got
    assert all(f"| e2e ({GPU}) |" in g and f"| n/a (incomplete: {words}) | n/a |" in g
               for g in got), got
    assert not [g for g in got if "**no**" in g or "| yes |" in g]


# ---------------------------------------------------------------------------- swap (GPU)
def swap_file(res, **gpu):
    rows = [{"model": "resnet50", "method": m, "batch": b, "status": "ok", "throughput": t,
             "unit": "images/s"}
            for m, t in (("save_on_cpu", 400.0), ("window+vmalloc", 800.0)) for b in (64, 256)]
    rows.append({"model": "resnet50", "method": "window+vmalloc", "batch": 384, "status": "ok",
                 "throughput": 700.0})
    write(res, "swap.json", {
        "meta": {"command": "python bench/swap.py"},
        "cpu_overhead": [{"model": "m", "plain_step_s": 0.1, "swap_step_s": 0.101,
                          "overhead_pct": 1.0, "hooks_per_step": 4}],
        "gpu": {"budget": 16 << 30, "window": 2 << 30, "rows": rows,
                "meta": dict(META, command="python bench/swap.py --gpu-only"), **gpu}})


@pytest.mark.parametrize("gpu, words", [
    ({"quick": True, "incomplete": False, "not_run": 0},
     "n/a (--quick grid only: two batches a model cannot show a larger batch)"),
    ({"quick": False, "incomplete": True, "not_run": 14},
     "n/a (incomplete: 5 of 19 configurations)"),
    ({"quick": True, "incomplete": True, "not_run": 3},
     "n/a (--quick grid only: two batches a model cannot show a larger batch; incomplete: "
     "5 of 8 configurations)"),
])
def test_swap_gpu_goal_waits_for_the_full_complete_grid(res, gpu, words):
    swap_file(res, **gpu)
    got = goals(res, "swap (GPU)")
    assert len(got) == 1 and words in got[0] and got[0].endswith("| n/a |"), got
    assert "`python bench/swap.py --gpu-only`" in got[0]


def test_swap_gpu_goal_judged_on_the_full_complete_grid(res):
    swap_file(res, quick=False, incomplete=False, not_run=0)
    got = goals(res, "swap (GPU)")
    assert got == ["| swap (GPU) | window+vmalloc beats save_on_cpu at every batch that fits and "
                   "reaches a larger batch | resnet50: faster at 2/2 batches, largest batch 384 "
                   "vs peers' 256 | yes |"]
    swap_file(res)   # a file from before --gpu-only recorded quick/incomplete: judged as before
    assert goals(res, "swap (GPU)") == got
