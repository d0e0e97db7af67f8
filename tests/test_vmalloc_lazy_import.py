"""``import vmalloc`` is lazy (PEP 562): the torch-free planners and the simulator import
``vmalloc.sizes`` and the extension ``vmalloc._core``, and that must not load the allocator, the
report or the PyTorch hooks (nor torch) through ``vmalloc/__init__.py``. Each check runs in a
fresh interpreter, where nothing else has imported them yet."""
import json
import subprocess
import sys

import pytest

from _subproc import python_env

LEAVES = {"vmalloc", "vmalloc.sizes", "vmalloc._core"}

LOADED = """
import json, sys
print(json.dumps({"vmalloc": sorted(m for m in sys.modules if m.split(".")[0] == "vmalloc"),
                  "torch": "torch" in sys.modules}))
"""


def loaded_after(code: str, tmp_path) -> dict:
    """The vmalloc modules (and whether torch) a fresh interpreter holds after ``code``."""
    p = subprocess.run([sys.executable, "-c", code + LOADED], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_importing_the_planners_and_the_simulator_loads_no_allocator(tmp_path):
    got = loaded_after("import scheduler.planners.rotor, scheduler.planners.pofo, "
                       "scheduler.simulate\n", tmp_path)
    assert set(got["vmalloc"]) <= LEAVES and not got["torch"], got


def test_planning_loads_only_the_leaf_modules(tmp_path):
    pytest.importorskip("vmalloc._core")
    got = loaded_after("""
import scheduler.planners.rotor as rotor, scheduler.planners.pofo as pofo
from scheduler import Chain, simulate
chain = Chain.random(6, seed=1)
plan = rotor.solve(chain, "1GiB")                   # vmalloc.sizes and vmalloc._core
pofo.solve(chain, pofo.min_memory(chain) * 1.5, 1.0)
simulate(chain, plan, memory="1GiB")
""", tmp_path)
    assert set(got["vmalloc"]) == LEAVES and not got["torch"], got


def test_import_of_sizes_and_core_loads_nothing_else(tmp_path):
    pytest.importorskip("vmalloc._core")
    got = loaded_after("import vmalloc.sizes, vmalloc._core\n", tmp_path)
    assert set(got["vmalloc"]) == LEAVES and not got["torch"], got


def test_vmalloc_report_is_the_function_and_no_module_takes_its_name(tmp_path):
    """``vmalloc.report`` is the function (DESIGN.md) and carries ``add_section`` (README); the
    module that builds and renders reports is ``vmalloc.report_format``, so importing it (first,
    here) binds no module over the function, and there is no ``vmalloc.report`` module."""
    loaded_after("""
from vmalloc.report_format import to_text        # the format module first
import importlib.util
import vmalloc
assert callable(vmalloc.report) and vmalloc.report.__module__ == "vmalloc.pluggable.live_report"
assert vmalloc.report.add_section is vmalloc.add_report_section
vmalloc.report.add_section("lazy", lambda: {"n": 1})
assert vmalloc.report(format="json")["lazy"] == {"n": 1}
assert "lazy:" in to_text(vmalloc.report(format="json"))
from vmalloc import report
assert report is vmalloc.report
assert importlib.util.find_spec("vmalloc.report") is None
""", tmp_path)
