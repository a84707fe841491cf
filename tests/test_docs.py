"""README.md and docs/ figures are rendered (`make docs`), and a hand-edited one is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmscale import docs
from llmscale.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_every_rendered_block_is_current() -> None:
    """Fails when a figure changed without `make docs` (python -m llmscale.docs)."""
    assert docs.stale() == []


def _copy(tmp_path: Path) -> Path:
    for b in {b.file for b in docs.BLOCKS} | {"docs/results/results.json"}:
        (tmp_path / b).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / b, tmp_path / b)
    return tmp_path


def test_a_hand_edited_figure_is_stale_and_make_docs_restores_it(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    i, j = docs._span(text, "megatron-ratios")
    edited = text[:i] + text[i:j].replace("for all", "for all 1") + text[j:]
    readme.write_text(edited)
    claims_md = root / "docs" / "claims.md"
    claims_md.write_text(claims_md.read_text().replace("**does not hold here**", "**holds**", 1))
    assert docs.stale(root) == ["README.md: megatron-ratios", "docs/claims.md: the whole file"]
    assert docs.write(root) == ["README.md: megatron-ratios", "docs/claims.md: the whole file"]
    assert docs.stale(root) == []
    assert readme.read_text() == text


def test_a_changed_result_makes_its_block_stale(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    res = root / "docs" / "results" / "results.json"
    res.write_text(res.read_text().replace('"measured": 1.252900896207904', '"measured": 1.5', 1))
    stale = docs.stale(root)
    assert "README.md: measured-vs-predicted" in stale  # the recompute row
    assert "docs/claims.md: the whole file" in stale  # claims' recompute row
    assert "docs/results.md: the whole file" in stale  # make results' page of the same file


def test_timings_alone_do_not_make_a_block_stale(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    i, j = docs._span(text, "plan-speed")
    readme.write_text(text[:i] + docs.TIMING.sub("9.99 s", text[i:j]) + text[j:])
    assert docs.stale(root) == []


def test_the_plan_example_is_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    """README's plan block is what `llmscale plan` prints (timings masked)."""
    assert main(docs.DEMO_PLAN.split()[1:]) == 0
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.splitlines())
    text = (ROOT / "README.md").read_text()
    i, j = docs._span(text, "plan-demo")
    block = text[i:j].strip().removeprefix("```text\n").removesuffix("\n```")
    assert block.startswith(f"$ {docs.DEMO_PLAN}\n")
    got = block.split("\n", 1)[1]
    assert docs.TIMING.sub("<t>", got) == docs.TIMING.sub("<t>", printed)
