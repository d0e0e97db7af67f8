"""vmalloc.cupy's owner object frees an allocation when CuPy lets it go. A free that fails (a
double free: a bug elsewhere) is said on stderr as the PyTorch deleter says it, never raised
from the finaliser; a closed allocator's owners say nothing (the memory went with it). Runs
without CuPy: the owner is plain Python over any allocator."""
import gc

import pytest

from vmalloc import Allocator
from vmalloc import cupy as vcupy


@pytest.fixture
def alloc():
    a = Allocator("host", chunk_size=64 << 10)
    yield a
    a.close()


def test_an_owner_frees_its_allocation(alloc, capsys):
    p = alloc.malloc(1000)
    owner = vcupy._Owner(alloc, p)
    del owner
    gc.collect()
    assert alloc.stats()["num_free"] == 1 and capsys.readouterr().err == ""


def test_a_failed_free_is_said_not_swallowed(alloc, capsys, monkeypatch):
    monkeypatch.setattr(vcupy, "_failed_frees", 0)
    p = alloc.malloc(1000)
    owner = vcupy._Owner(alloc, p)
    alloc.free(p)                      # freed behind the owner's back
    del owner
    gc.collect()
    err = capsys.readouterr().err
    assert f"vmalloc.cupy: free({p:#x}) failed" in err and "not a live allocation" in err


def test_failed_frees_are_counted_after_the_third(capsys, monkeypatch):
    monkeypatch.setattr(vcupy, "_failed_frees", 0)
    for _ in range(100):
        vcupy._say_failed_free(0x1000, ValueError("sticky"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5   # 3 in full, then at 10 and 100
    assert "further failed frees are counted" in lines[2]
    assert lines[3].startswith("vmalloc.cupy: 10 frees") and lines[4].startswith(
        "vmalloc.cupy: 100 frees")


def test_a_closed_allocators_owner_says_nothing(capsys):
    a = Allocator("host", chunk_size=64 << 10)
    owner = vcupy._Owner(a, a.malloc(1000))
    a.close()
    del owner
    gc.collect()
    assert capsys.readouterr().err == ""
