"""Chain's input checks and JSON loading: sizes past a float's range are refused by name
(every planner sums and converts sizes to floats: 10**400 failed later in a DP's binding or
as an OverflowError), a file whose name starts with '[' or '{' is read as a file, and a
chain whose xbar[s] is below x[s+1] is taken as given (documented, not refused: tests build
such chains on purpose)."""
import pytest

from scheduler import Chain, Plan, simulate

GOOD = dict(fw=[1, 1, 1], bw=[1, 1, 1], x=[1, 1, 1], xbar=[1, 1, 1], delta=[1, 1, 1])


@pytest.mark.parametrize("x", [[1, 10 ** 400, 1], [1.5, 10 ** 400, 1], [10 ** 5000, 1, 1]],
                         ids=["ints", "mixed", "huge"])
def test_a_size_past_a_floats_range_is_named(x):
    where = x.index(max(x))
    with pytest.raises(ValueError, match=rf"Chain\.x\[{where}\]: an int of \d+ bits is too "
                                         r"large for a float"):
        Chain(**dict(GOOD, x=x))


def test_large_sizes_within_a_floats_range_are_kept_exactly():
    assert Chain(**dict(GOOD, x=[10 ** 300, 1, 1])).x[0] == 10 ** 300


@pytest.mark.parametrize("name", ["[run1]chain.json", "{a}.json"])
def test_a_file_named_like_json_text_is_read_as_a_file(tmp_path, monkeypatch, name):
    c = Chain.random(2, seed=0)
    c.to_json(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    assert Chain.from_json(name) == c
    assert Chain.from_json(c.to_json()) == c      # JSON text is still JSON text


def test_xbar_below_the_next_input_is_taken_as_given():
    # xbar[0] = 2 < x[1] = 5: B 0 and F_all 1 count the input of stage 1 as xbar[0]
    c = Chain(fw=[1, 1], bw=[1, 1], x=[3, 5], xbar=[2, 4], delta=[3, 5])
    r = simulate(c, Plan([("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)]))
    assert r.peak_memory == 3 + 2 + 4 + 5   # B 1: x0, xbar0, xbar1, delta1
