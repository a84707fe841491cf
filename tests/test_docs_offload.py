"""docs/offload.md's figures are rendered from their records (docs_offload.py): each block
changes when its record does, and each recorder writes what its renderer reads."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmscale import docs, docs_offload
from llmscale.bench import offload, offload_kernels, offload_lsp

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/offload.md"
RECORDS = ("results", "offload", "offload-lsp", "offload-kernels")


@pytest.fixture(autouse=True)
def _page_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Render docs/offload.md's blocks only (the others, plan searches included, are
    tests/test_docs.py's)."""
    monkeypatch.setattr(docs, "BLOCKS", tuple(b for b in docs.BLOCKS if b.file == PAGE))


def _copy(tmp_path: Path) -> Path:
    for f in {b.file for b in docs.BLOCKS} | {f"docs/results/{n}.json" for n in RECORDS}:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_file():
            shutil.copy(ROOT / f, tmp_path / f)
    return tmp_path


def _doctor(
    root: Path, name: str, suite: str, edit: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    path = root / "docs" / "results" / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data[suite])
    path.write_text(json.dumps(data))
    rec: dict[str, Any] = data[suite]
    return rec


def _block(root: Path, name: str) -> str:
    text = (root / PAGE).read_text()
    i, j = docs._span(text, name)
    return text[i:j]


def _stale(root: Path) -> set[str]:
    return {s.removeprefix(f"{PAGE}: ") for s in docs.stale(root) if s.startswith(PAGE)}


def test_the_lsp_fits_and_losses_are_the_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def edit(rec: dict[str, Any]) -> None:
        rec["loss"]["lsp"][-1] = 4.987
        rec["fits"][0]["before"] = 1.666
        rec["rank3"]["after"] = 0.123

    _doctor(root, "offload-lsp", offload_lsp.SUITE, edit)
    assert _stale(root) == {"lsp-fit"}
    docs.write(root)
    text = _block(root, "lsp-fit")
    assert "→ 4.99 against ZeRO-Offload's" in text
    assert "–1.67 (a random sketch)" in text
    assert "a fit goes from 0.98 to 0.12" in text


def test_the_kernel_timings_are_the_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def edit(rec: dict[str, Any]) -> None:
        rec["adamw_s"]["fused"] = 0.0012345
        rec["adamw_s"]["foreach"] = 0.5  # slower than exact: the words follow
        big = next(c for c in rec["compression"] if c["m"] == 4096)
        big["dense_s"] = 0.777

    rec = _doctor(root, "offload-kernels", offload_kernels.SUITE, edit)
    assert _stale(root) == {"host-adamw-kernels", "lsp-compress-times", "lsp-regime"}
    docs.write(root)
    adamw = _block(root, "host-adamw-kernels")
    exact = rec["adamw_s"]["exact"]
    assert "takes 1.2 ms a step" in adamw
    assert f"({exact / 0.0012345:.1f}x)" in adamw
    assert "500 ms, is slower still" in adamw
    assert "777 ms dense against" in _block(root, "lsp-regime")
    assert "against 777 ms dense." in _block(root, "lsp-compress-times")


def test_the_regime_ratios_are_the_small_models_shapes() -> None:
    text = docs_offload.lsp_regime(docs.Context(ROOT / "docs/results/results.json", measure=False))
    # T d (m + n + d) / (T m n) at the capped d: 128 for 256-wide sides, 64 for 128 x 256
    assert f"- {128 * (256 + 768 + 128) / (256 * 768):.2f} of it for the 256 x 768 matrices" in text
    assert f"- {128 * (256 + 256 + 128) / (256 * 256):.2f} of it for the 256 x 256 matrices" in text
    assert f"- {64 * (128 + 256 + 64) / (128 * 256):.2f} of it for the 128 x 256 matrices" in text
    assert "costs 0.27 of the weight gradient" in text and "s/d = 1/32" in text


def test_the_offload_bench_figures_are_the_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def edit(rec: dict[str, Any]) -> None:
        for r in rec["runs"]:
            if r["offload"] == "optimizer+params":
                r["param_peak_bytes"] = {"serial": 7 * 2**20, "overlap": 7 * 2**20}
            if (r["offload"], r["link_gbps"]) == ("optimizer", 1.0):
                r["step_s"]["overlap"] = 2 * r["step_s"]["off"]

    _doctor(root, "offload", offload.SUITE, edit)
    assert {"params-offload-bytes", "offload-reading", "params-offload-traffic"} <= _stale(root)
    docs.write(root)
    assert "at most 7.00 MiB during a step" in _block(root, "params-offload-bytes")
    assert "the step serially " in _block(root, "offload-reading")
    assert "overlapped +100%" in _block(root, "offload-reading")
    assert "without offload (+100%" in _block(root, "params-offload-traffic")


def test_zero_offloads_link_time_is_the_finetune_record(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def edit(suite: dict[str, Any]) -> None:
        row = next(r for r in suite["rows"] if r["config"] == "optimizer"
                   and r["quantity"] == "bytes moved per step")  # fmt: skip
        row["measured"] = 123_000_000

    _doctor(root, "results", "finetune", edit)
    assert "zero-offload-link" in _stale(root)
    docs.write(root)
    assert "ZeRO-Offload's 123 MB of copies a step take 123 ms" in _block(root, "zero-offload-link")


def test_the_recorders_write_what_the_renderers_read(tmp_path: Path) -> None:
    res = tmp_path / "results"
    ctx = docs.Context(res / "results.json", measure=False)
    assert docs_offload.lsp_fit(ctx).startswith("Not measured yet")
    assert docs_offload.host_adamw_kernels(ctx).startswith("Not measured yet")

    offload_lsp.main(
        ["--steps", "2", "--check-every", "1", "--json-out", str(res / "offload-lsp.json")]
    )
    rec = json.loads((res / "offload-lsp.json").read_text())[offload_lsp.SUITE]
    assert {f["step"] for f in rec["fits"]} <= {1, 2} and 1 in {f["step"] for f in rec["fits"]}
    assert all(f["after"] <= f["before"] for f in rec["fits"])  # a fit keeps its best values
    assert len(rec["loss"]["lsp"]) == len(rec["loss"]["optimizer"]) == 2
    assert rec["loss"]["lsp"][0] == rec["loss"]["optimizer"][0]  # same start, same batch
    assert rec["rank3"]["after"] < 0.5 * rec["rank3"]["before"]
    text = docs_offload.lsp_fit(ctx)
    assert f"the loss went {rec['loss']['lsp'][0]:.2f} → {rec['loss']['lsp'][1]:.2f}" in text

    offload_kernels.main(["--model", "tiny", "--repeats", "1",
                          "--json-out", str(res / "offload-kernels.json")])  # fmt: skip
    rec = json.loads((res / "offload-kernels.json").read_text())[offload_kernels.SUITE]
    assert set(rec["adamw_s"]) == set(offload_kernels.ADAMW_KERNELS)
    assert len(rec["fused_vs_exact"]) == 5 and all(math.isfinite(x) for x in rec["fused_vs_exact"])
    assert [(c["m"], c["n"], c["d"]) for c in rec["compression"]] == list(
        offload_kernels.COMPRESSIONS
    )
    text = docs_offload.lsp_compress_times(ctx)
    c = rec["compression"][0]
    assert (
        f"takes {docs_offload._ms(c['sparse_s'])} against {docs_offload._ms(c['dense_s'])}" in text
    )

    offload.main(["--model", "tiny", "--rounds", "1", "--block", "2", "--warmup", "1", "--seq",
                  "32", "--batch", "2", "--accum", "1", "--link-gbps", "0", "--offload",
                  "optimizer+params", "--json-out", str(res / "offload.json")])  # fmt: skip
    (run,) = json.loads((res / "offload.json").read_text())[offload.SUITE]["runs"]
    assert run["param_bytes"]["serial"] == 0 < run["param_peak_bytes"]["serial"]
    assert run["param_peak_bytes"]["serial"] < run["param_bytes"]["off"] == 4 * run["n_params"]
    text = docs_offload.params_offload_bytes(ctx)
    assert f"at most {run['param_peak_bytes']['serial'] / 2**20:.2f} MiB" in text
