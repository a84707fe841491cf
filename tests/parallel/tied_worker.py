"""One rank of the tied-embedding tests: train several layouts in turn in one process group.

    torchrun --nproc-per-node N tests/parallel/tied_worker.py SPEC.json

SPEC: {"out": folder, "base": [overrides...], "layouts": [{"name", "args", "run"?}, ...]}.
The rank holding pipeline stage s at data, tensor and context rank 0 writes OUT/NAME.stage{s}.pt:
losses, validation loss, final parameters gathered to full tensors, and after every step the
sha256 of the full embedding (`tok_embeddings.weight`) and of the last stage's copy
(`output.weight`) where this rank's stages hold them, this rank's metrics rows, and how many
distinct tensors hold the tied weight on this rank (`tied_tensors`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llmscale.config import load_config
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


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for layout in spec["layouts"]:
        run_dir = out / layout.get("run", layout["name"])
        cfg = load_config(None, [*spec["base"], "--job.run_dir", str(run_dir), *layout["args"]])
        t = Trainer(cfg)
        hashes: list[dict[str, str]] = []
        rows: list[dict] = []  # this rank's metrics rows (its own memory figures)
        step = t.train_step

        def train_step(step=step, t=t, hashes=hashes, rows=rows):
            row = step()
            rows.append(dict(row))
            hashes.append(tied_hashes(t))
            return row

        t.train_step = train_step
        result = t.fit()
        params = full_parameters(t.model_parts)
        d = t.dims
        if d.dp_rank == 0 and d.tp_rank == 0 and d.cp_rank == 0:
            payload = {
                "losses": result.losses,
                "val_loss": result.val_loss,
                "steps_done": result.steps_done,
                "params": params,
                "hashes": hashes,
                "first_row": rows[0] if rows else None,
                "rows": rows,
                "tied_tensors": tied_tensors(t),
            }
            torch.save(payload, out / f"{layout['name']}.stage{d.pp_rank}.pt")
        t.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
