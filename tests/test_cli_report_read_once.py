"""``vmalloc report FILE`` reads the file once, bounded and gunzipped, and parses those bytes
(``report_format.loads``): it read it a second time as text, so a gzipped report failed "not
a JSON report (not text)" and a piped one (``cat r.json | vmalloc report /dev/stdin``) failed
on the empty second read."""
import gzip
import json
import os

from hypothesis import given, settings, strategies as st

from vmalloc.cli import main
from vmalloc.report_format import build, load, loads, save, to_text

STATS = {"requested_current": 0, "requested_peak": 10, "mapped_current": 0,
         "mapped_peak": 2 << 20, "physical_current": 0, "physical_peak": 2 << 20,
         "num_malloc": 1, "num_free": 1, "num_map": 1, "num_unmap": 1, "chunk_size": 2 << 20}


def saved(tmp_path):
    path = str(tmp_path / "r.json")
    save(build(STATS, source="vmalloc"), path)
    return path


def test_a_gzipped_report_is_printed(tmp_path, capsys):
    path = saved(tmp_path)
    gz = tmp_path / "r.json.gz"
    gz.write_bytes(gzip.compress(open(path, "rb").read()))
    assert main(["report", str(gz)]) == 0
    assert capsys.readouterr().out.strip() == to_text(load(path))


def test_a_piped_report_is_printed(tmp_path, capsys):
    """As ``cat r.json | vmalloc report /dev/stdin``: a pipe gives its bytes once."""
    path = saved(tmp_path)
    data = open(path, "rb").read()
    assert len(data) < 60000   # fits the pipe's buffer: written whole before the read
    r, w = os.pipe()
    try:
        os.write(w, data)
        os.close(w)
        assert main(["report", f"/dev/fd/{r}"]) == 0
    finally:
        os.close(r)
    assert capsys.readouterr().out.strip() == to_text(load(path))


def test_a_report_that_is_not_text_says_so(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"memory": "\xff\xfe"}')
    assert main(["report", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"vmalloc report: {bad}: not a JSON report (not text)"


def test_a_text_report_is_named_as_one(tmp_path, capsys):
    """``VMALLOC_REPORT=frag.txt`` writes text: ``vmalloc report`` names it so (it gave the
    first bytes in hex), and a too-large report is a report, not a trace."""
    path = saved(tmp_path)
    text = tmp_path / "frag.txt"
    save(load(path), str(text))
    assert main(["report", str(text)]) == 2
    assert "a text report" in capsys.readouterr().err
    assert main(["report", path, "--max-trace-size", "100"]) == 2
    assert "the limit for one report" in capsys.readouterr().err


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(STATS)), st.integers(0, 1 << 40)),
       st.sampled_from(["", "  \n", "\ufeff"]))
def test_loads_reads_what_save_wrote(stats, pad):
    """``loads`` of a saved report's bytes (blank-padded, or with a UTF-8 byte-order mark) is
    the report, as ``load`` of the file."""
    rep = build(stats, source="vmalloc")
    raw = (pad + json.dumps(rep, indent=1, sort_keys=True)).encode()
    assert loads(raw, "r.json") == json.loads(json.dumps(rep))
