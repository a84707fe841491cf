"""One rank of the tied-embedding tests: layout_worker.py's loop, with two more entries.

    torchrun --nproc-per-node N tests/parallel/tied_worker.py SPEC.json

SPEC as layout_worker.py's. Besides layout_worker's payload, the rank holding pipeline stage s
at data, tensor and context rank 0 writes, in OUT/NAME.stage{s}.pt, the sha256 after every step
of the full embedding (`tok_embeddings.weight`) and of the last stage's copy (`output.weight`)
where this rank's stages hold them (`hashes`), and how many distinct tensors hold the tied
weight on this rank (`tied_tensors`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

from layout_worker import after_each_step, train_layouts

from llmscale.parallel import full_parameters
from llmscale.tensors import local_tensor
from llmscale.train.trainer import Trainer

TIED = ("tok_embeddings.weight", "output.weight")


def tied_hashes(t: Trainer) -> dict[str, str]:
    """sha256 of the full values of this rank's tied weights (a collective over the stage)."""
    out = {}
    for part in t.model_parts:
        names = [n for n, _ in part.named_parameters() if n in TIED]
        if names:
            full = full_parameters([part])
            for n in names:
                out[n] = hashlib.sha256(full[n].numpy().tobytes()).hexdigest()
    return out


def tied_tensors(t: Trainer) -> int:
    """How many distinct tensors (by storage) hold the tied weight on this rank: 1 where the
    embedding reads the head's weight (a V without data parallelism), 2 where both are held."""
    ptrs = set()
    for part in t.model_parts:
        for m in (part.tok_embeddings, part.output):
            if m is not None:
                ptrs.add(local_tensor(m.weight).data_ptr())  # (a DTensor's own shard)
    return len(ptrs)


def hook(t: Trainer) -> Callable[[], dict[str, Any]]:
    """Hash the tied weights after every step; count their tensors after training."""
    hashes: list[dict[str, str]] = []
    after_each_step(t, lambda row: hashes.append(tied_hashes(t)))
    return lambda: {"hashes": hashes, "tied_tensors": tied_tensors(t)}


if __name__ == "__main__":
    train_layouts(sys.argv[1], hook)
