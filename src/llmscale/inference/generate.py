"""`llmscale generate`: continue a prompt with a run's newest checkpoint (KV-cached decoding)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from llmscale.errors import ConfigError
from llmscale.inference.tokenizer import run_tokenizer
from llmscale.model.decode import generate
from llmscale.model.transformer import build_model
from llmscale.train.trainer import resolve_device
from llmscale.train.weights import read_run_weights


@dataclass(frozen=True)
class Generated:
    text: str  # the prompt followed by the continuation
    prompt_ids: list[int]
    new_ids: list[int]
    step: int


def generate_text(
    run_dir: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    step: int | None = None,
    device: str = "auto",
) -> Generated:
    if not prompt:
        raise ConfigError("--prompt", prompt, "a non-empty text")
    if max_new_tokens < 0:
        raise ConfigError("--max-new-tokens", max_new_tokens, ">= 0")
    if not (math.isfinite(temperature) and temperature >= 0):  # nan compares False
        raise ConfigError("--temperature", temperature, "a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ConfigError("--top-k", top_k, ">= 0 (0 = no cut)")
    run = read_run_weights(run_dir, step)
    tok = run_tokenizer(run.cfg, run.path)
    ids = tok.encode(prompt)
    limit = run.cfg.model.max_seq_len
    if len(ids) >= limit:
        raise ConfigError("--prompt", f"{len(ids)} tokens", f"fewer than model.max_seq_len={limit}")
    model = build_model(run.cfg.model, "meta")
    model.to_empty(device=resolve_device(device))
    model.load_state_dict(run.state_dict)
    model.init_buffers()
    new = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        eos_id=tok.eos_id,
        vocab_limit=tok.vocab_limit,
        suppress=tok.holes(),
    )
    return Generated(text=tok.decode(ids + new), prompt_ids=ids, new_ids=new, step=run.step)
