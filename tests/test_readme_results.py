"""bench/readme_results.py: README.md's Results block is generated from bench/results/*.json.

The first test is the CI guard: it fails when someone commits new benchmark JSON without
regenerating the README (run `python bench/readme_results.py` and commit README.md)."""
import json
import os

import pytest

from bench import readme_results as rr

README_TEXT = "# Title\n\nintro\n\n## Results\n\nkept\n\n{begin}\nold text\n{end}\n\n## After\n\ntail\n"


def test_committed_readme_block_is_up_to_date(capsys):
    assert rr.main(["--check"]) == 0, capsys.readouterr().err


def test_committed_results_all_parse():
    block = rr.render()
    assert "unexpected structure" not in block
    assert "Simulated (scheduler.simulate" in block  # planner numbers say they are simulated


def _write(d, name, obj):
    (d / name).write_text(json.dumps(obj))


@pytest.fixture
def fake(tmp_path):
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    _write(res, "alloc_micro.json", {
        "meta": {"command": "python bench/alloc_micro.py --quick", "machine": "testbox"},
        "host": {"fast_large_2chunks": {"nbytes": 4 << 20, "cpp_pairs_per_s": 6.25e6,
                                        "cpp_ns_per_pair": 160.0, "python_pairs_per_s": 1.5e6,
                                        "python_ns_per_pair": 666.7},
                 "fast_small_4KiB": {"nbytes": 4096, "cpp_pairs_per_s": 4.5e6,
                                     "cpp_ns_per_pair": 222.2, "python_pairs_per_s": 1e6,
                                     "python_ns_per_pair": 1000.0},
                 "remap": [{"k": 2, "pairs_per_s": 1e5, "us_per_pair": 10.0,
                            "chunks_remapped_per_pair": 1.5, "unmaps_per_pair": 1.5,
                            "us_per_chunk_remapped": 6.666}]},
        "cuda": {"skipped": "no CUDA device"}})
    _write(res, "swap.json", {
        "meta": {"command": "python bench/swap.py", "torch": "x"},
        "cpu_overhead": [{"model": "m", "plain_step_s": 0.1, "swap_step_s": 0.102,
                          "overhead_pct": 2.0, "hooks_per_step": 4}],
        "gpu": {"budget": 1 << 30, "window": 1 << 28, "rows": [
            {"model": "r50", "method": "save_on_cpu", "batch": 8, "status": "ok", "throughput": 10.0,
             "unit": "images/s"},
            {"model": "r50", "method": "save_on_cpu", "batch": 16, "status": "oom"},
            {"model": "r50", "method": "window+vmalloc", "batch": 8, "status": "ok", "throughput": 12.0},
            {"model": "r50", "method": "window+vmalloc", "batch": 16, "status": "ok", "throughput": 11.0},
            {"model": "r50", "method": "torchtune", "status": "n/a", "error": "not installed"}]}})
    _write(res, "e2e-H200-2026-01-02.json", {
        "meta": {"gpu": "H200", "driver": "1.0", "torch": "2.13", "date": "2026-01-02",
                 "command": "python bench/e2e.py --models resnet50"},
        "results": [
            {"model": "resnet50", "method": "native", "batch_size": 64, "throughput": 1000.0,
             "unit": "images/s", "peak_bytes": 3 << 30, "budget_bytes": 16 << 30, "status": "ok",
             "note": "loss bitwise equal to plain training (2 steps)"},
            {"model": "resnet50", "method": "native", "batch_size": 1440, "throughput": None,
             "unit": "images/s", "peak_bytes": None, "budget_bytes": 16 << 30, "status": "oom",
             "note": ""},
            {"model": "resnet50", "method": "window+vmalloc", "batch_size": 1440, "throughput": 650.0,
             "unit": "images/s", "peak_bytes": 15 << 30, "budget_bytes": 16 << 30, "status": "ok",
             "note": "loss bitwise equal to plain training (2 steps)"},
            {"model": "resnet50", "method": "torchtune-offload", "batch_size": 64, "throughput": None,
             "unit": "images/s", "peak_bytes": None, "budget_bytes": 16 << 30, "status": "error",
             "note": "ModuleNotFoundError: No module named 'torchtune'"}]})
    (res / "e2e-H200-2026-01-02-throughput.png").write_bytes(b"png")
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT.format(begin=rr.BEGIN, end=rr.END))
    return res, readme


def _run(res, readme, *extra):
    return rr.main(["--results", str(res), "--readme", str(readme), *extra])


def test_generates_tables_notes_and_commands(fake, capsys):
    res, readme = fake
    assert _run(res, readme, "--check") == 1
    assert "out of date" in capsys.readouterr().err
    assert _run(res, readme) == 0
    text = readme.read_text()
    before, rest = text.split(rr.BEGIN)
    inner, after = rest.split(rr.END)
    # nothing outside the markers changes
    assert before == README_TEXT.format(begin=rr.BEGIN, end=rr.END).split(rr.BEGIN)[0]
    assert after == "\n\n## After\n\ntail\n"
    assert "old text" not in inner
    # numbers from the files, the goals, the commands, the figure link, GPU state
    assert "| fast_large_2chunks | 4.00 MiB | 6.2 M | 160 | 1.5 M | yes |" in inner
    assert "| fast_small_4KiB | 4.00 KiB | 4.5 M | 222 | 1.0 M | **no** |" in inner
    assert "Reproduce: `python bench/alloc_micro.py --quick`" in inner
    assert "GPU part skipped: no CUDA device (no GPU lent)." in inner
    assert "| swap (GPU) | window+vmalloc beats save_on_cpu" in inner
    assert "faster at 1/1 batches, largest batch 16 vs peers' 8 | yes |" in inner
    assert "| torchtune | n/a | n/a |" in inner
    assert "| window+vmalloc |  | 650 (15.00 GiB) |" in inner
    assert "| native | 1000 (3.00 GiB) | x |" in inner
    assert "window+vmalloc 650 images/s = 65.0% of plain PyTorch's best" in inner
    assert "| e2e (H200) | >= 60% of unconstrained throughput at batch 1440 | 65.0% (window+vmalloc) | yes |" in inner
    assert "| e2e (H200) | ResNet-50 batch >= 2048 within 16 GiB | batch 1440 (window+vmalloc) | **no** |" in inner
    assert "torchtune-offload: ModuleNotFoundError" in inner
    assert "[e2e-H200-2026-01-02-throughput.png](bench/results/e2e-H200-2026-01-02-throughput.png)" in inner
    assert "e2e-H200-2026-01-02-memory.png" not in inner      # no such file: no link
    # missing files: one line each, not an error
    for name in ("fragmentation.json", "planners_time.json", "checkpointing.json", "offloading.json",
                 "pofo.json", "mimose.json", "checkpoint_real-*.json"):
        assert f"No results file (`bench/results/{name}`)" in inner
    assert "checkpoint_real (GPU)" in inner and "not run" in inner


def test_gpu_sessions_tests_and_traces_render_with_goals(fake):
    """What scripts/gpu-check brings back from a GPU: its progress record, pytest -m gpu's
    outcome per test, the real traces' model error; a quick or incomplete e2e file says so
    and sets no goal row (its batches stop short of the goal's)."""
    res, readme = fake
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "torch": "2.11.0+cu130",
            "date": "2026-12-01", "source": "0123abcd0123abcd"}
    _write(res, "gpu-progress.json", {"steps": {
        "pytest-gpu": {"status": "ok", "seconds": 201.4, **meta},
        "e2e-resnet50": {"status": "partial", "seconds": 330.0, **meta}}})
    _write(res, "gpu-tests.json", {"meta": meta,
                                   "summary": {"passed": 51, "failed": 1, "skipped": 1,
                                               "total": 53, "seconds": 190.2},
                                   "tests": [{"test": "tests/test_a.py::test_slow", "outcome": "passed",
                                              "seconds": 40.0},
                                             {"test": "tests/test_a.py::test_bad", "outcome": "failed",
                                              "seconds": 1.0, "message": "AssertionError: 3 != 4\nmore"}]})
    _write(res, "traces-gpu.json", {"meta": {**meta, "command": "python bench/traces/record_gpu.py"},
                                    "rows": [{"trace": "resnet50-b256-native-gpu.json.gz",
                                              "status": "ok", "events": 1234,
                                              "peak_requested": 10 << 30, "reserved_peak": 12 << 30,
                                              "model_reserved_peak": 12.6 * 2 ** 30,
                                              "model_error_percent": 5.0},
                                             {"trace": "gpt2-s1024-b8-swap", "status": "error",
                                              "note": ["OOM"]}]})
    _write(res, "e2e-H200-quick.json", {
        "meta": {"gpu": "H200", "command": "python bench/e2e.py --quick --resume x",
                 "incomplete": True, "not_run": 7},
        "results": [{"model": "resnet50", "method": "native", "batch_size": 512,
                     "throughput": 900.0, "unit": "images/s", "peak_bytes": None,
                     "budget_bytes": 16 << 30, "status": "ok", "note": ""}]})
    e2e_file = res / "e2e-H200-2026-01-02.json"
    doc = json.loads(e2e_file.read_text())
    doc["results"].append({"model": "resnet50", "method": "torchtune-offload", "batch_size": 512,
                           "throughput": None, "unit": "images/s", "peak_bytes": None,
                           "budget_bytes": 16 << 30, "status": "unavailable",
                           "note": "ModuleNotFoundError: No module named 'torchtune'"})
    e2e_file.write_text(json.dumps(doc))
    _run(res, readme)
    inner = readme.read_text().split(rr.BEGIN)[1].split(rr.END)[0]
    assert ("- Not run: torchtune-offload (unavailable): ModuleNotFoundError: No module named "
            "'torchtune'.") in inner
    assert "| pytest-gpu | ok | 201 | NVIDIA H100 80GB HBM3 | 580.159.04 |" in inner
    assert "| e2e-resnet50 | partial |" in inner
    assert ("| pytest -m gpu (NVIDIA H100 80GB HBM3) | every GPU test passes on a GPU | "
            "51 of 52 passed | **no** |") in inner
    assert "- `tests/test_a.py::test_bad`: AssertionError: 3 != 4" in inner
    assert "Slowest: `test_slow` 40 s" in inner
    assert "| resnet50-b256-native-gpu.json.gz | 1234 | 10.00 GiB | 12.00 GiB | 12.60 GiB | +5.0% |" in inner
    assert "Not recorded: gpt2-s1024-b8-swap" in inner
    assert "worst +5.0% (resnet50-b256-native-gpu.json.gz), 1 traces | n/a |" in inner
    assert "- Incomplete: 7 jobs not run yet" in inner
    assert "batch 512 (native)" not in inner   # the quick file sets no goal row
    assert "unexpected structure" not in inner
    # pytest killed before it wrote its junit XML: said, and the goal is not met
    _write(res, "gpu-tests.json", {"meta": meta, "summary": {"passed": 1, "total": 1, "seconds": 0.0},
                                   "complete": False, "note": "no junit XML from pytest (killed)",
                                   "tests": [{"test": "tests/t.py::a", "outcome": "passed",
                                              "seconds": 0.0}]})
    _run(res, readme)
    inner = readme.read_text().split(rr.BEGIN)[1].split(rr.END)[0]
    assert "1 tests, 1 passed, 0 s in tests. no junit XML from pytest (killed)." in inner
    assert ("| every GPU test passes on a GPU | 1 of 1 passed (killed before the end) | **no** |"
            in inner)


def test_rerun_is_a_no_op_and_check_names_the_stale_section(fake, capsys):
    res, readme = fake
    _run(res, readme)
    first = readme.read_text()
    assert _run(res, readme) == 0 and readme.read_text() == first
    assert _run(res, readme, "--check") == 0
    data = json.loads((res / "swap.json").read_text())
    data["cpu_overhead"][0]["overhead_pct"] = 7.5
    _write(res, "swap.json", data)
    capsys.readouterr()
    assert _run(res, readme, "--check") == 1
    err = capsys.readouterr().err
    assert "Swap runtime overhead" in err and "Goals at a glance" in err
    assert "Allocator fast path" not in err
    assert readme.read_text() == first                        # --check never writes


def test_unexpected_structure_is_said_not_raised(fake):
    res, _ = fake
    _write(res, "pofo.json", {"slots": 50})
    block = rr.render(str(res), str(res.parent.parent))
    assert "Could not read `bench/results/pofo.json`: unexpected structure" in block


def test_readme_without_markers_is_refused(tmp_path, fake):
    res, _ = fake
    readme = tmp_path / "R.md"
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="results:begin"):
        _run(res, readme)


def test_number_formats_are_fixed():
    assert rr.num(0.016770359000000012) == "0.0168"
    assert rr.num(1.1726158979999894) == "1.17"
    assert rr.num(1210.457273999964) == "1210"
    assert rr.num(float("nan")) == "-" and rr.num(None) == "-"
    assert rr.rate(46129432.683860905) == "46.1 M"
    assert rr.size(3 << 30) == "3.00 GiB"
    assert rr.pct(12.98350016656484) == "+13.0%"
    assert os.path.basename(rr.RESULTS) == "results"


def test_a_null_where_an_object_is_expected_is_said_not_raised(fake):
    """"meta": null (AttributeError in a renderer, and in the goals' GPU checks): that file's
    section says it could not be read, naming it; the rest of the block is still written."""
    res, _ = fake
    doc = json.loads((res / "e2e-H200-2026-01-02.json").read_text())
    _write(res, "e2e-cpu-x.json", {**doc, "meta": None})
    _write(res, "checkpoint_real-cpu.json", {"meta": None, "models": []})
    block = rr.render(str(res), str(res.parent.parent))
    assert "Could not read `bench/results/e2e-cpu-x.json`: unexpected structure (AttributeError" in block
    assert "Could not read `bench/results/checkpoint_real-cpu.json`: unexpected structure " \
           "(AttributeError" in block
    assert "| fast_large_2chunks | 4.00 MiB | 6.2 M |" in block        # the other sections too
    assert "| e2e (H200) | >= 60% of unconstrained throughput at batch 1440 |" in block


def test_alloc_micro_gpu_remap_and_fresh_costs_and_which_device_measured_what(fake):
    res, _ = fake
    d = json.loads((res / "alloc_micro.json").read_text())
    fast = d["host"]["fast_large_2chunks"]
    d["cuda"] = {"device": "NVIDIA H100 80GB HBM3", "granularity": 2 << 20,
                 "vmalloc_fast_2chunks": fast,
                 "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 41.5, "pairs_per_s": 12000.0},
                                   {"k": 32, "us_per_chunk_remapped": 38.25, "pairs_per_s": 800.0}],
                 "vmalloc_fresh": [{"k": 1, "us_per_chunk_create_map_unmap_release": 900.0}]}
    _write(res, "alloc_micro.json", d)
    block = rr.render(str(res), str(res.parent.parent))
    sec = block.split("### Allocator fast path")[1].split("\n### ")[0]
    assert "Measured on the CPU:" not in sec     # not all of it: the GPU rows say where
    assert "Host rows measured on the CPU: vmalloc's host backend" in sec
    assert "GPU rows (the cuda backend, below) measured on NVIDIA H100 80GB HBM3." in sec
    assert "GPU part, measured on NVIDIA H100 80GB HBM3 (granularity 2.00 MiB):" in sec
    assert ("GPU remap path (every malloc unmaps and maps chunks): k=2: 41.5 us per chunk "
            "remapped (12.0 k pairs/s); k=32: 38.2 us per chunk remapped (800.0 pairs/s).") in sec
    assert "GPU fresh path (create + map + unmap + release a chunk): k=1: 900 us per chunk." in sec
    # the host's own rows, as before
    assert "Remap path (every malloc unmaps and maps chunks): k=2: 6.67 us per chunk" in sec
    # no GPU rows: the CPU says it all, as before
    d["cuda"] = {"skipped": "no CUDA device"}
    _write(res, "alloc_micro.json", d)
    sec = rr.render(str(res), str(res.parent.parent)).split("### Allocator fast path")[1]
    assert "Measured on the CPU: vmalloc's host backend" in sec.split("\n### ")[0]


def test_mimose_on_a_gpu_names_it_and_the_date(fake):
    res, _ = fake
    with open(os.path.join(rr.RESULTS, "mimose.json")) as f:
        d = json.load(f)
    d["meta"].update(device="cuda", gpu="NVIDIA H100 80GB HBM3", date="2026-12-01")
    _write(res, "mimose.json", d)
    sec = rr.render(str(res), str(res.parent.parent)).split("### Mimose")[1].split("\n### ")[0]
    assert "Measured on the GPU (NVIDIA H100 80GB HBM3):" in sec
    assert ", date 2026-12-01." in sec
    del d["meta"]["gpu"]   # a file from before the tags: the device as given
    _write(res, "mimose.json", d)
    sec = rr.render(str(res), str(res.parent.parent)).split("### Mimose")[1].split("\n### ")[0]
    assert "Measured on the GPU (cuda):" in sec
