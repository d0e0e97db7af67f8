"""vmalloc.atomic_file.write_atomic: reports, traces and the CLI's JSON are written whole or not at
all, through symbolic links, keeping the file's permission bits, and never sharing a
temporary file between writers."""
import os
import threading

import pytest

from vmalloc.atomic_file import write_atomic


def test_replaces_whole_keeps_mode_and_writes_through_links(tmp_path):
    f = tmp_path / "r.json"
    write_atomic(f, "old")
    os.chmod(f, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    write_atomic(link, b"new")
    assert link.is_symlink() and f.read_text() == "new"
    assert os.stat(f).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "r.json"]  # no leftovers


def test_a_failed_write_leaves_the_old_file_and_names_the_path(tmp_path):
    f = tmp_path / "r.json"
    write_atomic(f, "old")
    with pytest.raises(TypeError):
        write_atomic(f, 12)   # not bytes or str: fails mid-write
    assert f.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]
    with pytest.raises(OSError, match="nodir"):
        write_atomic(tmp_path / "nodir" / "x.json", "q")


def test_concurrent_writers_each_publish_a_whole_file(tmp_path):
    f = tmp_path / "r.json"
    texts = [str(i) * 100_000 for i in range(8)]
    errors = []

    def write(t):
        try:
            write_atomic(f, t)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and f.read_text() in texts and os.listdir(tmp_path) == ["r.json"]
