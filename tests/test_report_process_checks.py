"""What the exit report would ignore is said at start-up (vmalloc.report_process
.check_launch_variables): a WORLD_SIZE, RANK or LOCAL_RANK that is not an integer >= its least
value, a VMALLOC_REPORT_OWNER not of the form vmalloc sets; once each, never fatal."""
import subprocess
import sys

import pytest
from _subproc import python_env
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture
def P(monkeypatch):
    import vmalloc.report_process as P
    monkeypatch.setattr(P, "_warned", set())   # each test sees its own warnings
    return P


@pytest.mark.parametrize("env,words", [
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer >= 1"),
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer >= 1"),
    ({"RANK": "abc"}, "RANK='abc' is not an integer >= 0"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not an integer >= 0"),
    ({"VMALLOC_REPORT_OWNER": "garbage"}, "VMALLOC_REPORT_OWNER='garbage' is not <pid>:<rank>"),
    ({"VMALLOC_REPORT_OWNER": "12:x"}, "VMALLOC_REPORT_OWNER='12:x'"),
])
def test_a_bad_launch_variable_is_said_at_start_up_once(P, capsys, env, words):
    """WORLD_SIZE was read only at exit, for the report's "process" key: a bad one was said
    after the whole run; a garbage VMALLOC_REPORT_OWNER was ignored without a word."""
    P.check_launch_variables(env)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    P.check_launch_variables(env)
    P.process_identity(None, env)          # the exit report reads them again: said once
    P.report_path("frag.json", env)
    assert capsys.readouterr().err == ""


def test_good_launch_variables_are_silent(P, capsys):
    P.check_launch_variables({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                              "VMALLOC_REPORT_OWNER": "4242:3"})
    P.check_launch_variables({"VMALLOC_REPORT_OWNER": "4242:"})
    P.check_launch_variables({})
    assert capsys.readouterr().err == ""


def test_a_garbage_owner_is_replaced_by_the_process_that_claims_the_path(P, capsys):
    """Read as unset, it loses no report: the process that imports torch claims the path, so
    the processes it starts name theirs by pid."""
    env = {"VMALLOC_REPORT_OWNER": "not-a-pid"}
    P.claim_report(env, pid=100)
    assert env["VMALLOC_REPORT_OWNER"] == "100:"
    assert P.report_path("frag.json", env, pid=100) == "frag.json"
    assert P.report_path("frag.json", env, pid=101) == "frag.pid101.json"
    assert "VMALLOC_REPORT_OWNER='not-a-pid'" in capsys.readouterr().err


@given(st.text(alphabet=st.sampled_from("0129: x-\u00b2\u0663"), max_size=8) | st.text(max_size=8))
def test_any_owner_value_is_read_or_said(value):
    """Read when it is vmalloc's form (ASCII digits, ':', ASCII digits or nothing), else None;
    never an exception (a '\u00b2' passed str.isdigit, then int() raised)."""
    import re

    import vmalloc.report_process as P
    P._warned.discard(("VMALLOC_REPORT_OWNER", value))
    owner = P._owner({"VMALLOC_REPORT_OWNER": value})
    form = re.fullmatch(r"([0-9]+):([0-9]*)", value.strip())
    assert owner == (None if form is None else
                     (int(form.group(1)), int(form.group(2)) if form.group(2) else None))


@pytest.mark.parametrize("name,value", [("WORLD_SIZE", "0"), ("VMALLOC_REPORT_OWNER", "junk")])
def test_a_bad_launch_variable_is_said_before_the_program_runs(tmp_path, name, value):
    env = {k: v for k, v in python_env(VMALLOC_REPORT="-", **{name: value}).items()
           if k not in ("VMALLOC", "VMALLOC_WINDOW", "RANK", "LOCAL_RANK")}
    code = ("from vmalloc import _autoload; _autoload.install(); import sys; "
            "sys.stderr.write('program started\\n')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    said = f"{name}={value!r}"
    assert said in r.stderr and r.stderr.index(said) < r.stderr.index("program started")
