"""`llmscale generate` and the KV cache under it; `llmscale eval`.

Greedy decoding (temperature 0) must give transformers' greedy `generate` on the exported folder,
token for token; the cached forward must give the plain forward's logits (1e-5, fp32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_harness import hf_model

from llmscale.cli import main
from llmscale.inference.generate import generate_text
from llmscale.model.config import get_preset
from llmscale.model.decode import KVCache, forward_cached, generate
from llmscale.model.transformer import build_model
from llmscale.train.metrics import read_jsonl

TOL = 1e-5
PROMPT = "def main():\n    "


@pytest.mark.parametrize(
    "shape",
    [
        get_preset("tiny"),  # RoPE, grouped-query attention
        get_preset("gpt2-124m").with_overrides(
            vocab_size=264, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=64
        ),  # learned positions, tied head, biases
    ],
    ids=["llama", "gpt"],
)
def test_cached_logits_equal_the_plain_forward(shape) -> None:
    model = build_model(shape, seed=4).eval()
    x = torch.randint(0, 264, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
    cache = KVCache()
    pieces = [forward_cached(model, x[:, :7], cache)]  # the prompt at once
    pieces += [forward_cached(model, x[:, i : i + 1], cache) for i in range(7, 19)]  # one by one
    pieces.append(forward_cached(model, x[:, 19:], cache))  # a chunk after cached tokens
    assert cache.length == 24
    assert (torch.cat(pieces, dim=1) - full).abs().max() < TOL


def test_padded_ids_are_never_generated() -> None:
    model = build_model(get_preset("tiny"), seed=1)
    prompt = list(b"hello")
    for temperature in (0.0, 1.5):
        new = generate(model, prompt, 40, temperature=temperature, vocab_limit=100, seed=2)
        assert len(new) == 40 and max(new) < 100


def test_suppressed_ids_are_never_generated() -> None:
    """Ids a tokenizer file skips (`RunTokenizer.holes`): the ones sampled most, suppressed."""
    model = build_model(get_preset("tiny"), seed=1)
    with torch.no_grad():
        model.output.weight[[7, 9]] *= 30  # type: ignore[index,union-attr]
    free = generate(model, list(b"hello"), 40, temperature=1.0, seed=2)
    assert {7, 9} & set(free)  # they would come out
    new = generate(model, list(b"hello"), 40, temperature=1.0, seed=2, suppress=[7, 9])
    assert len(new) == 40 and not {7, 9} & set(new)


@pytest.mark.parametrize("which", ["trained_run", "llama_run"])
def test_greedy_text_equals_transformers_generate(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Both the briefly trained tiny run (which mostly continues with spaces) and a run started
    from a random Llama (whose continuation varies from token to token)."""
    from transformers import AutoTokenizer

    run = request.getfixturevalue(which)
    ours = generate_text(run, PROMPT, max_new_tokens=24, temperature=0.0)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        theirs = hf_model(out).generate(ids, max_new_tokens=24, do_sample=False)
    assert theirs[0, ids.shape[1] :].tolist() == ours.new_ids
    assert tok.decode(theirs[0], skip_special_tokens=True) == ours.text
    assert ours.text.startswith(PROMPT) and len(ours.new_ids) > 0
    if which == "llama_run":
        assert len(set(ours.new_ids)) >= 5


def test_generate_prints_the_prompt_and_continuation_only(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", str(trained_run), "--prompt", PROMPT, "--max-new-tokens", "10"]
    assert main([*args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    expected = generate_text(trained_run, PROMPT, max_new_tokens=10, temperature=0.0).text
    assert greedy == expected + "\n"
    assert main([*args, "--temperature", "1.0", "--top-k", "1"]) == 0
    assert capsys.readouterr().out == greedy  # the single likeliest token: greedy
    sampled = [
        main([*args, "--temperature", "1.0", "--seed", "5"]) or capsys.readouterr().out
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and sampled[0].startswith(PROMPT)


def test_eval_gives_the_runs_validation_loss(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same number the run logged at its end (same weights, batches and code path)."""
    logged = [r for r in read_jsonl(trained_run / "metrics.jsonl") if r.get("kind") == "eval"]
    assert main(["eval", str(trained_run), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 3
    assert abs(res["val_loss"] - logged[-1]["val_loss"]) < 1e-6
    assert res["perplexity"] == pytest.approx(math.exp(res["val_loss"]), rel=1e-12)
    assert main(["eval", str(trained_run)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("step 3: val_loss ") and "perplexity" in line


def test_four_commands_from_a_folder_of_text_to_a_generating_hf_model(tmp_path: Path) -> None:
    """README's "Your own data": data prepare (BPE) -> train on the prepared folder -> export ->
    generate; transformers' greedy continuation of the exported folder equals llmscale's."""
    from transformers import AutoTokenizer

    texts = tmp_path / "texts"
    texts.mkdir()
    src = Path(json.__file__).parent  # the standard library's json package: a few documents
    for f in sorted(src.glob("*.py")):
        (texts / f.name).write_text(f.read_text())
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    prep = ["data", "prepare", "--input", str(texts), "--tokenizer", "bpe"]
    assert main([*prep, "--vocab-size", "300", "--val-fraction", "0.2", "--out", str(data)]) == 0
    train = ["train", "--data.dataset", str(data), "--job.run_dir", str(run)]
    steps = ["--train.steps", "3", "--data.seq_len", "32", "--metrics.progress", "false"]
    assert main([*train, *steps, "--checkpoint.enabled", "true"]) == 0
    assert main(["export", str(run), "--out", str(out)]) == 0
    ours = generate_text(run, "def load(", max_new_tokens=12, temperature=0.0)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 300  # the tokenizer's own ids; the model's vocabulary is padded to 320
    ids = tok("def load(", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        theirs = hf_model(out).generate(ids, max_new_tokens=12, do_sample=False)
    assert theirs[0, ids.shape[1] :].tolist() == ours.new_ids
    assert max(ours.new_ids) < 300  # the padded ids (300..319) never come out
