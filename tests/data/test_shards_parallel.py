"""Training on a prepared dataset under tensor, pipeline and data parallelism (2 gloo ranks):
the same losses as one process, with the padded vocabulary split over tp ranks and masked on
each rank's shard of the logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from corpus_maker import prepare_small

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_harness import (  # noqa: E402
    BASE,
    RTOL,
    assert_same_run,
    rel_error,
    run_layouts,
    single_process_reference,
)

from llmscale.config import load_config  # noqa: E402
from llmscale.data.prepared import load_meta, padded_vocab_size  # noqa: E402
from llmscale.train.trainer import Trainer  # noqa: E402


@pytest.mark.slow
def test_prepared_dataset_under_tp_pp_and_fsdp_equals_one_process(tmp_path) -> None:
    # 330 real ids pad to 384 for tp = 1 and tp = 2 alike: the same model in every layout, whose
    # tp = 2 vocabulary shards are [0, 192) and [192, 384): the mask cuts inside the second.
    ds = prepare_small(tmp_path / "a", "bpe", 330)
    meta = load_meta(ds)
    assert meta.vocab_size == 330 and padded_vocab_size(330, 1) == padded_vocab_size(330, 2) == 384
    data = ["--data.dataset", str(ds)]
    ref = single_process_reference(tmp_path / "single", tuple(data))
    assert ref["params"]["output.weight"].shape[0] == 384
    # 300 ids pad to 320 under tp = 1 but 384 under tp = 2: a run cut after 2 steps in one
    # process and resumed under tp = 2 keeps its checkpoint's 320.
    ds300 = prepare_small(tmp_path / "b", "bpe", 300)
    data300 = ["--data.dataset", str(ds300)]
    ref300 = single_process_reference(tmp_path / "single300", tuple(data300))
    world = tmp_path / "world2"
    ckpt = ("--checkpoint.enabled", "true")
    cut = Trainer(load_config(None, [*BASE, *data300, *ckpt, "--checkpoint.stop_after", "2",
                                     "--job.run_dir", str(world / "cut")]))  # fmt: skip
    assert cut.fit().losses == ref300["losses"][:2]
    cut.close()
    layouts = [
        {"name": "tp2", "args": [*data, "--parallel.tp", "2"]},
        {"name": "pp2", "args": [*data, "--parallel.pp", "2"]},
        {"name": "fsdp2", "args": [*data, "--parallel.dp_shard", "2"]},
        {"name": "tp2resume", "run": "cut",
         "args": [*data300, *ckpt, "--checkpoint.resume", "true", "--parallel.tp", "2"]},
    ]  # fmt: skip
    got = run_layouts(2, world, layouts)
    for name in ("tp2", "pp2", "fsdp2"):
        assert_same_run(got[name], ref, name)
    resumed = got["tp2resume"]
    assert resumed["params"]["output.weight"].shape[0] == 320
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], ref300["losses"][2:], strict=True):
        assert rel_error(a, b) < RTOL, (a, b)
    assert rel_error(resumed["val_loss"], ref300["val_loss"]) < RTOL
