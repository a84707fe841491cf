"""Training on a prepared dataset under tensor, pipeline and data parallelism (2 gloo ranks):
the same losses as one process, with the padded vocabulary split over tp ranks and masked on
each rank's shard of the logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from corpus_maker import prepare_small

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_harness import assert_same_run, run_layouts, single_process_reference  # noqa: E402

from llmscale.data.prepared import load_meta, padded_vocab_size  # noqa: E402


@pytest.mark.slow
def test_prepared_dataset_under_tp_pp_and_fsdp_equals_one_process(tmp_path) -> None:
    # 330 real ids pad to 384 for tp = 1 and tp = 2 alike: the same model in every layout, whose
    # tp = 2 vocabulary shards are [0, 192) and [192, 384): the mask cuts inside the second.
    ds = prepare_small(tmp_path, "bpe", 330)
    meta = load_meta(ds)
    assert meta.vocab_size == 330 and padded_vocab_size(330, 1) == padded_vocab_size(330, 2) == 384
    data = ["--data.dataset", str(ds)]
    ref = single_process_reference(tmp_path / "single", tuple(data))
    assert ref["params"]["output.weight"].shape[0] == 384
    layouts = [
        {"name": "tp2", "args": [*data, "--parallel.tp", "2"]},
        {"name": "pp2", "args": [*data, "--parallel.pp", "2"]},
        {"name": "fsdp2", "args": [*data, "--parallel.dp_shard", "2"]},
    ]
    got = run_layouts(2, tmp_path / "world2", layouts)
    for name in ("tp2", "pp2", "fsdp2"):
        assert_same_run(got[name], ref, name)
