"""The console helpers shared by the commands."""

import pytest

from llmscale.ui import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (45.33 * 2**20, "45.3 MiB"),
        (1.5 * 2**30, "1.5 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (2048 * 2**40, "2048.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_human_bytes(n: float, text: str) -> None:
    assert human_bytes(n) == text


def test_value_range() -> None:
    from llmscale.ui import value_range

    assert value_range([0.87, 0.81, 0.83], 2) == "0.81–0.87"
    assert value_range([0.8149, 0.8151], 2) == "0.81–0.82"
    assert value_range([0.8141, 0.8149], 2) == "0.81"  # both read the same
    assert value_range([1.0], 3) == "1.000"
