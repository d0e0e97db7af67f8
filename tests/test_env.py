import pytest

from vmalloc.env import VARIABLES, EnvConfig, parse_flag, read_env


def test_unset_is_inactive():
    cfg = read_env({})
    assert cfg == EnvConfig()
    assert not cfg.active


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("Yes", True), (" on ", True),
                                      ("0", False), ("", False), ("off", False), ("FALSE", False)])
def test_flag_values(value, on):
    assert read_env({"VMALLOC": value}).enabled is on


def test_sizes_are_parsed_with_the_shared_parser():
    cfg = read_env({"VMALLOC": "1", "VMALLOC_CHUNK_SIZE": "20MiB", "VMALLOC_BUDGET": "16GiB",
                    "VMALLOC_WINDOW": "2GB", "VMALLOC_REPORT": "out.json"})
    assert cfg == EnvConfig(True, 20 << 20, 16 << 30, 2_000_000_000, "out.json")
    assert cfg.active


def test_budget_zero_means_no_cap_and_window_alone_activates():
    cfg = read_env({"VMALLOC_BUDGET": "0", "VMALLOC_WINDOW": "1GiB"})
    assert cfg.budget is None and cfg.window == 1 << 30 and cfg.active and not cfg.enabled


@pytest.mark.parametrize("name,value", [
    ("VMALLOC", "maybe"), ("VMALLOC", "2"), ("VMALLOC_CHUNK_SIZE", "2 parsecs"),
    ("VMALLOC_CHUNK_SIZE", "0"), ("VMALLOC_BUDGET", "-1GiB"), ("VMALLOC_BUDGET", "1.5B"),
    ("VMALLOC_WINDOW", "lots"), ("VMALLOC_WINDOW", "0"),
])
def test_malformed_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        read_env({name: value})


def test_parse_flag_names_the_variable():
    with pytest.raises(ValueError, match="SOME_FLAG"):
        parse_flag("x", "SOME_FLAG")


def test_every_variable_is_documented():
    assert set(VARIABLES) == {"VMALLOC", "VMALLOC_CHUNK_SIZE", "VMALLOC_BUDGET", "VMALLOC_WINDOW",
                              "VMALLOC_REPORT"}
