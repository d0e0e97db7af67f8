import pytest

from vmalloc.sizes import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("2MiB", 2 << 20), ("40MB", 40_000_000), ("16GiB", 16 << 30), ("1048576", 1 << 20),
    (4096, 4096), ("1.5KiB", 1536), (" 2 mib ", 2 << 20), ("0", 0), ("3b", 3),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "2XB", "-1", -1, "1.3B", True, None, [1]])
def test_parse_size_rejects_and_names_the_knob(bad):
    with pytest.raises(ValueError, match="VMALLOC_WINDOW"):
        parse_size(bad, "VMALLOC_WINDOW")


def test_format_size():
    assert format_size(3 << 20) == "3.00 MiB"
    assert format_size(10) == "10 B"


@pytest.mark.parametrize("bad", ["9" * 5000, 2**64, str(2**64), "17179869184GiB", 2.0**70,
                                 "0." + "1" * 5000 + "KiB"])
def test_sizes_from_2_to_the_64_up_are_refused_naming_the_knob(bad):
    # issue 16 item 10: a 5000-digit VMALLOC_BUDGET was accepted
    with pytest.raises(ValueError, match=r"VMALLOC_BUDGET: .*(too large|whole number)"):
        parse_size(bad, "VMALLOC_BUDGET")


def test_the_largest_size_is_accepted():
    assert parse_size(str(2**64 - 1)) == 2**64 - 1


@pytest.mark.parametrize("n,shown", [(1048575, "1.00 MiB"), (1048571, "1.00 MiB"),
                                     ((1 << 30) - 1, "1.00 GiB"), (1023, "1023 B"),
                                     (1024 * 1023, "1023.00 KiB"), (-1048575, "-1.00 MiB"),
                                     (1 << 50, "1024.00 TiB")])
def test_format_size_rolls_over_when_rounding_reaches_1024(n, shown):
    from vmalloc.sizes import format_size
    assert format_size(n) == shown


def test_numpy_and_tensor_integers_are_sizes():
    # a budget computed with numpy or torch (np.int64, a 0-d integer tensor) is its value
    import numpy as np
    import torch
    for v in (np.int64(100_000_000), np.uint32(100_000_000), torch.tensor(100_000_000),
              np.float64(1e8), np.float32(2 ** 20)):
        assert parse_size(v, "budget") == int(v)
    for bad in (np.bool_(True), torch.tensor(True), torch.tensor([1, 2]), np.float64(2.5),
                np.int64(-5), torch.tensor(1.5)):
        with pytest.raises(ValueError, match="budget"):
            parse_size(bad, "budget")
