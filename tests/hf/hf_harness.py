"""Helpers of the Hugging Face tests: offline transformers, short checkpointed runs, both models."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Nothing is downloaded: transformers only reads the folders the tests write. Set before any
# transformers import (huggingface_hub reads it when imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from llmscale.bench.jobs import short_job  # noqa: E402
from llmscale.config import JobConfig, load_config  # noqa: E402
from llmscale.model.transformer import Transformer, build_model  # noqa: E402
from llmscale.train.trainer import run_training  # noqa: E402
from llmscale.train.weights import read_run_weights  # noqa: E402

# Every run: the tiny preset (unless overridden), 40 stdlib files (2 of them validation), sequences of 32, 3 steps of
# 4 sequences, a checkpoint at the end.
BASE = short_job(
    train__micro_batch_size=4,
    train__global_batch_size=4,
    train__eval_sequences=8,
    checkpoint__enabled=True,
)


def run_config(run_dir: Path, *overrides: str) -> JobConfig:
    return load_config(None, [*BASE, "--job.run_dir", str(run_dir), *overrides])


def train_run(run_dir: Path, *overrides: str) -> Path:
    run_training(run_config(run_dir, *overrides))
    return run_dir


def run_model(run_dir: Path, step: int | None = None) -> Transformer:
    """llmscale's own model with the run's checkpointed weights, fp32 on the CPU."""
    w = read_run_weights(run_dir, step)
    model = build_model(w.cfg.model)
    model.load_state_dict(w.state_dict)
    return model.eval()


def hf_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def save_random_llama(folder: Path, **overrides: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, object] = dict(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    shape.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return folder


def llama_style_tokenizer(texts: list[str], path: Path) -> Path:
    """A 300-id BPE file with Llama's specials (<unk> <s> </s>, and <pad>) and its template
    (`<s> $A`: BOS before every text), trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path))
    return path
