"""The .pth hook: inert without the variables, validating with them, hooking `import torch`.

Each case starts a fresh interpreter whose user site-packages (a temporary directory) holds the
.pth file, exactly as pip installs it into site-packages.
"""
import site
import subprocess
import sys
import textwrap

import pytest

from _subproc import PTH, autoload_env

pytestmark = pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")


def run(tmp_path, code, env=None, extra_path=()):
    clean = autoload_env(tmp_path, *extra_path, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def test_pth_is_one_import_line():
    lines = [l for l in open(PTH).read().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os;")


def test_inert_without_the_variables(tmp_path):
    r = run(tmp_path, """
        import sys
        print(sorted(m for m in sys.modules if m.startswith(("vmalloc", "torch", "scheduler"))))
    """, env={"VMALLOC": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_variable_set_hooks_torch_import_without_importing_torch(tmp_path):
    r = run(tmp_path, """
        import sys
        print("torch" in sys.modules, "vmalloc._autoload" in sys.modules)
        import torch
        print(type(torch.__spec__.loader).__name__)
    """, env={"VMALLOC": "1", "VMALLOC_BUDGET": "1GiB"})
    assert r.returncode == 0, r.stderr
    first, loader = r.stdout.split("\n")[:2]
    assert first == "False True"            # nothing heavy at start-up
    assert loader != "_AfterExec"           # torch keeps its real loader
    assert "no CUDA device" in r.stderr or "vmalloc" not in r.stderr   # CPU torch: warns, goes on


def test_stats_say_why_the_variable_did_not_enable_vmalloc(tmp_path):
    # a CPU-only torch: VMALLOC=1 warns at import and leaves PyTorch's allocator; stats()
    # then names that, not "set VMALLOC=1" (a new user's walk-through: it told them so)
    r = run(tmp_path, """
        import torch, vmalloc
        if not torch.cuda.is_available():
            try:
                vmalloc.stats()
            except RuntimeError as e:
                print(e)
    """, env={"VMALLOC": "1"})
    assert r.returncode == 0, r.stderr
    if r.stdout.strip():   # (on a GPU machine vmalloc is enabled and nothing is printed)
        assert "VMALLOC=1 is set, but torch sees no CUDA device" in r.stdout, r.stdout


def test_malformed_value_stops_the_program_naming_it(tmp_path):
    r = run(tmp_path, "print('should not run')", env={"VMALLOC": "1", "VMALLOC_BUDGET": "lots"})
    assert r.returncode == 2
    assert "VMALLOC_BUDGET" in r.stderr and "should not run" not in r.stdout
    r = run(tmp_path, "print('x')", env={"VMALLOC": "perhaps"})
    assert r.returncode == 2 and "VMALLOC:" in r.stderr


def test_window_calls_the_swap_runtime(tmp_path):
    fake = tmp_path / "fake"
    (fake / "scheduler" / "runtime").mkdir(parents=True)
    (fake / "scheduler" / "__init__.py").write_text("")
    (fake / "scheduler" / "runtime" / "__init__.py").write_text("")
    (fake / "scheduler" / "runtime" / "swap.py").write_text(
        "calls = []\ndef install_global(window, budget=None):\n    calls.append((window, budget))\n")
    r = run(tmp_path, """
        import torch, scheduler.runtime.swap as s
        print(s.calls)
    """, env={"VMALLOC_WINDOW": "2GiB", "VMALLOC_BUDGET": "8GiB"}, extra_path=[str(fake)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"[({2 << 30}, {8 << 30})]"


def test_window_without_swap_runtime_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    (empty / "scheduler").mkdir(parents=True)
    (empty / "scheduler" / "__init__.py").write_text("")
    r = run(tmp_path, "import torch", env={"VMALLOC_WINDOW": "1GiB"}, extra_path=[str(empty)])
    assert r.returncode != 0
    assert "install_global" in r.stderr and "VMALLOC_WINDOW" in r.stderr


def test_exit_report_is_written(tmp_path):
    out = tmp_path / "rep.json"
    r = run(tmp_path, "import torch", env={"VMALLOC_REPORT": str(out)})
    assert r.returncode == 0, r.stderr
    import json
    rep = json.loads(out.read_text())
    assert rep["source"] in ("none", "torch-native", "vmalloc") and "memory" in rep
