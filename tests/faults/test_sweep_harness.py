"""bench/bad_inputs.py, the usability review's sweep: how it reads the review and classifies a
case (the sweep itself runs for ~30 minutes: `python bench/bad_inputs.py`, not a test)."""

from __future__ import annotations

import pytest

from llmscale.bench.bad_inputs import REVIEW, classify, parse_cases, parse_setups, trains

TB = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: x\n'


@pytest.mark.parametrize(
    ("command", "rc", "out", "expected"),
    [
        ("llmscale train --x 1", 2, "llmscale train: error: x: got 1; allowed: 2\n", "clean"),
        ("llmscale train --x 1", 2, "usage: ...\nllmscale train: error: ...\n", "rc 2, 2 lines"),
        ("llmscale plan --gpus 7", 1, "no plan fits\n", "rc 1"),
        ("llmscale plan --gpus 8", 0, "a table\n", "ok"),
        ("llmscale train", None, "", "hang"),
        ("llmscale train", 1, TB, "traceback"),
        ("torchrun --nproc-per-node 2 -m llmscale train", 1, TB + "ChildFailedError\n",
         "tr-traceback"),
        # Our own command that launches torchrun must not hide behind torchrun's traceback.
        ("llmscale train --nproc-per-node 2", 1, TB, "traceback"),
    ],
)  # fmt: skip
def test_classify(command: str, rc: int | None, out: str, expected: str) -> None:
    assert classify(command, rc, out) == expected


def test_which_commands_train() -> None:
    assert trains("llmscale train --train.steps 3")
    assert trains("torchrun --standalone -m llmscale train")
    assert not trains("llmscale train --dry-run")
    assert not trains("llmscale plan --gpus 8")


@pytest.mark.skipif(not REVIEW.is_file(), reason="the review is in ../shared, beside a checkout")
def test_the_reviews_cases_are_all_read() -> None:
    text = REVIEW.read_text()
    cases = parse_cases(text)
    assert (len(cases), sum(c.new for c in cases)) == (433, 280)
    assert len({c.id for c in cases}) == 433
    silent = [c.id for c in cases if "silent" in c.review_class]
    assert len(silent) == 22 and "DS23" in silent and "CL01" in silent
    ds23 = next(c for c in cases if c.id == "DS23")
    assert ds23.command == "llmscale train --data.dataset ./data/mine --job.run_dir $RD $TB"
    assert (
        parse_setups(text)["DS24"]
        == "rm -rf runs-test/DS24 && cp -a fixtures/run_bpe runs-test/DS24"
    )
