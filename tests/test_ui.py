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
