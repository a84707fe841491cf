"""What `selective` gives back under the CPU flash kernel and the math kernel
(`bench/selective.py`, docs/memory-model.md's table), against a hand count and the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmscale.bench import selective as sel
from llmscale.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
MHA = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=100, max_seq_len=16
)


def test_selective_gives_back_the_log_sum_exp_only_under_the_cpu_flash_kernel() -> None:
    none, selective = (sel.saved_bytes(sel.MODEL, m, "auto") for m in sel.MODES)
    assert none.kernel_node == "ScaledDotProductFlashAttentionForCpuBackward0"
    # 4 heads x 4 B of fp32 log-sum-exp per token, 3 x 10 tokens, 4 blocks
    assert none.bytes - selective.bytes == 4 * 4 * 3 * 10 * 4 == 1920
    assert sel.saving_by_hand(sel.MODEL, "flash") == 1920
    assert sel.planner_kernel(sel.MODEL, "auto") == "flash"
    for m, got in zip(sel.MODES, (none, selective), strict=True):
        assert sel.predicted_bytes(sel.MODEL, m, "flash") == got.bytes


@pytest.mark.parametrize(("cfg", "b", "s"), [(sel.MODEL, 3, 10), (MHA, 2, 7)], ids=["gqa", "mha"])
def test_selective_under_the_math_kernel_equals_the_hand_count(
    cfg: ModelConfig, b: int, s: int
) -> None:
    none, selective = (sel.saved_bytes(cfg, m, "math", b, s) for m in sel.MODES)
    assert "FlashAttention" not in none.kernel_node
    assert none.bytes - selective.bytes == sel.saving_by_hand(cfg, "math", b, s)
    if cfg is sel.MODEL:  # (8 x 48 - 8 x 24 + 4 x 4 x 10) B per token, 30 tokens, 4 blocks
        assert none.bytes - selective.bytes == 352 * 30 * 4 == 42240
    # checkpointed, the core keeps the same q, k, v whichever kernel runs it
    assert selective.bytes == sel.saved_bytes(cfg, "selective", "auto", b, s).bytes
    assert selective.bytes == sel.predicted_bytes(cfg, "selective", "math", b, s)


def test_the_record_is_what_the_runtime_keeps_today() -> None:
    """docs/results/selective.json (docs/memory-model.md's table) against a fresh measurement:
    fails when torch or the runtime changes what it saves (rerun the bench's --json-out)."""
    rec = json.loads((ROOT / "docs/results/selective.json").read_text())[sel.SUITE]
    assert ModelConfig(**rec["model"]) == sel.MODEL
    got = {r["config"]: r["measured"] for r in rec["rows"]}
    assert got == {
        f"{backend} recompute={m}": sel.saved_bytes(sel.MODEL, m, backend).bytes
        for backend in sel.BACKENDS
        for m in sel.MODES
    }


def test_json_out_writes_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "selective.json"
    sel.main(["--json-out", str(out)])
    rec = json.loads(out.read_text())[sel.SUITE]
    assert rec["command"] == f"python -m llmscale.bench.selective --json-out {out}"
    assert len(rec["rows"]) == 4 and all(r["unit"] == "B" for r in rec["rows"])
    assert "auto recompute=none" in capsys.readouterr().out
