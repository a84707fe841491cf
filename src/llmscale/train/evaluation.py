"""The fixed evaluation set: which validation sequences are scored, and how their loss adds up.

`train.eval_sequences` names the set: the first N windows of the validation files (all of them
when there are fewer), in file order. The validation loss is the mean over all their tokens,
summed in float64 and divided once, so it does not depend on how the sequences were batched:
any micro-batch size, data-parallel split or pipeline grouping gives the same number (to the
last bits of each token's fp32 loss).

Each data-parallel replica scores a contiguous slice of the set, padded to whole groups (a
micro-batch, or a pipeline step's micro-batches) so that every replica runs the same number of
forwards (FSDP's all-gathers and the pipeline schedules need that). Padding rows repeat a real
sequence with every target set to IGNORE, so they add neither loss nor tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE = -100  # F.cross_entropy's ignore_index (loss_parallel honours it too)


def local_eval_rows(
    rows: torch.Tensor, dp_rank: int, dp: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's slice of the eval set as (inputs, targets), padded to a multiple of
    `group` rows; every replica gets the same number of rows.

    `rows` is the whole set, (N, seq_len + 1) token ids. Targets of padding rows are IGNORE.
    """
    n = rows.shape[0]
    per = -(-n // dp)
    padded = max(group, -(-per // group) * group)
    mine = rows[dp_rank * per : min((dp_rank + 1) * per, n)]
    inputs, targets = mine[:, :-1], mine[:, 1:].clone()
    k = padded - mine.shape[0]
    if k:
        pad = rows[:1, :-1].expand(k, -1)
        inputs = torch.cat([inputs, pad])
        targets = torch.cat([targets, torch.full_like(pad, IGNORE)])
    return inputs.contiguous(), targets


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[sum of the next-token cross-entropies, number of scored tokens], float64.

    Each token's loss is computed in fp32 and the sum taken in float64, so the sum of a set is
    the same however it is split into batches. Targets equal to IGNORE are not scored. Logits
    split over the vocabulary (TP) need torch's `loss_parallel` around this call, as for the
    training loss.
    """
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="none", ignore_index=IGNORE
    )
    if isinstance(losses, DTensor):
        losses = losses.full_tensor()
    scored = (targets != IGNORE).sum()
    return torch.stack([losses.double().sum(), scored.double()])
