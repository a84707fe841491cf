"""Export of a run on a Llama-style tokenizer whose vocabulary the model pads (300 -> 320 ids).

The tokenizer is a BPE file with Llama's specials and its template (`<s> $A`: BOS before every
text); `data prepare` encodes documents without it, special-token text as text. The export must
hold what training saw: a 300-row vocabulary (transformers' perplexity then equals `llmscale
eval`'s, which masks the padding; with the 20 untrained rows kept it is measurably higher), a
tokenizer that encodes as the shards do, bf16 weights at half the bytes, shards with an index.
`generate` encodes a prompt as a document and gives transformers' greedy ids on the export.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_harness import hf_model, llama_style_tokenizer, run_model

from llmscale.cli import main
from llmscale.data.prepared import dataset_tokenizer, document_ids, load_meta
from llmscale.data.stream import PackedStream
from llmscale.hf.convert import to_hf_state_dict
from llmscale.hf.folder import write_folder
from llmscale.inference.export import export_run
from llmscale.inference.generate import generate_text
from llmscale.inference.tokenizer import run_tokenizer
from llmscale.train.weights import read_run_weights

PROMPT = "def load(s, <s> and </s> stay text"  # Llama's special-token names, as plain text


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("padded")
    texts = root / "texts"
    texts.mkdir()
    src = Path(json.__file__).parent  # the standard library's json package: a few documents
    docs = [f.read_text() for f in sorted(src.glob("*.py"))]
    for i, d in enumerate(docs):
        (texts / f"{i}.py").write_text(d + "\n# <s> not a BOS </s>\n")
    tok = llama_style_tokenizer(docs, root / "tokenizer.json")
    data, run = root / "data", root / "run"
    prep = ["data", "prepare", "--input", str(texts), "--tokenizer", str(tok)]
    assert main([*prep, "--val-fraction", "0.3", "--out", str(data)]) == 0
    train = ["train", "--data.dataset", str(data), "--job.run_dir", str(run)]
    steps = ["--train.steps", "3", "--data.seq_len", "32", "--metrics.progress", "false"]
    assert main([*train, *steps, "--checkpoint.enabled", "true"]) == 0
    return run


def hf_val_loss(run: Path, folder: Path) -> float:
    """transformers' mean next-token loss over `llmscale eval`'s set: the first
    train.eval_sequences windows of the first validation shard."""
    w = read_run_weights(run)
    meta = json.loads((Path(w.cfg.data.dataset) / "meta.json").read_text())
    val = np.fromfile(Path(w.cfg.data.dataset) / "val-00000.bin", dtype=meta["dtype"])
    stream = PackedStream(val, w.cfg.data.seq_len, seed=0, shuffle=False)
    rows = stream.next_batch(min(w.cfg.train.eval_sequences, stream.n_windows)).long()
    with torch.no_grad():
        logits = hf_model(folder)(rows[:, :-1]).logits.float()
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="none"
    )
    return float(losses.double().mean())


def test_export_drops_the_padding_and_gives_evals_perplexity(
    padded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = export_run(padded_run, tmp_path / "hf")
    assert (done.vocab_size, done.suppressed) == (300, 0)
    config = json.loads((done.out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["dtype"] == "float32"
    assert "torch_dtype" not in config and "rope_parameters" in config
    assert main(["eval", str(padded_run), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["perplexity"]
    theirs = math.exp(hf_val_loss(padded_run, done.out))
    assert abs(theirs / ours - 1) < 1e-3  # measured 1.3e-8
    # With the 20 padding rows kept, the export is far off (what the drop fixes).
    w = read_run_weights(padded_run)
    kept = write_folder(
        tmp_path / "kept",
        w.cfg.model,
        to_hf_state_dict(w.cfg.model, w.state_dict),
        run_tokenizer(w.cfg).files,
    )
    assert math.exp(hf_val_loss(padded_run, kept)) / ours - 1 > 1e-2  # measured +7.0%

    card = (done.out / "README.md").read_text()
    assert str(padded_run.resolve()) in card and "step 3" in card and "300 ids" in card
    assert "validation loss" in card and "training loss at step 3" in card


def test_sampling_the_export_never_gives_a_padding_id(padded_run: Path, tmp_path: Path) -> None:
    out = export_run(padded_run, tmp_path / "hf").out
    x = torch.tensor([document_ids_of(padded_run, "def ")])
    torch.manual_seed(0)
    with torch.no_grad():
        ids = hf_model(out).generate(
            x.repeat(8, 1), max_new_tokens=60, do_sample=True, temperature=2.0, top_k=0
        )
    assert int(ids.max()) < 300 and ids.shape[1] > x.shape[1]


def document_ids_of(run: Path, text: str) -> list[int]:
    return run_tokenizer(read_run_weights(run).cfg).encode(text)


def test_tokenizer_and_generate_encode_as_the_training_data(
    padded_run: Path, tmp_path: Path
) -> None:
    """No BOS (the file's template adds one; training never saw it), `<s>` text stays text;
    transformers' tokenizer on the export gives the same ids, and its greedy generate the
    same continuation as `llmscale generate`."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    w = read_run_weights(padded_run)
    data = Path(w.cfg.data.dataset)
    as_shards = document_ids(dataset_tokenizer(load_meta(data)), [PROMPT])[0]
    bos = Tokenizer.from_file(str(data / "tokenizer.json")).token_to_id("<s>")
    assert bos not in as_shards
    plain = Tokenizer.from_file(str(data / "tokenizer.json")).encode(PROMPT).ids
    assert plain != as_shards  # the file alone adds BOS and turns "<s>" into the special token

    out = export_run(padded_run, tmp_path / "hf").out
    auto = AutoTokenizer.from_pretrained(out)
    assert auto(PROMPT)["input_ids"] == as_shards
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False

    ours = generate_text(padded_run, PROMPT, max_new_tokens=12, temperature=0.0)
    assert ours.prompt_ids == as_shards
    with torch.no_grad():
        theirs = hf_model(out).generate(
            torch.tensor([as_shards]), max_new_tokens=12, do_sample=False
        )
    assert theirs[0, len(as_shards) :].tolist() == ours.new_ids


def test_bf16_halves_the_weights_and_shards_load_in_transformers(
    padded_run: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    def tensor_bytes(folder: Path) -> int:
        total = 0
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as s:
                total += sum(s.get_tensor(k).nbytes for k in s.keys())  # noqa: SIM118
        return total

    fp32 = export_run(padded_run, tmp_path / "fp32").out
    bf16 = export_run(padded_run, tmp_path / "bf16", dtype="bf16").out
    assert 2 * tensor_bytes(bf16) == tensor_bytes(fp32)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(bf16) / size(fp32) < 0.51

    sharded = export_run(padded_run, tmp_path / "sharded", max_shard_size="100KB").out
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert all(p.stat().st_size < 100_000 + 50_000 for p in sharded.glob("*.safetensors"))
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf_model(fp32)(x).logits, hf_model(sharded)(x).logits
        assert torch.equal(a, b)
        ours = run_model(padded_run)(x)[..., :300]
    assert float((ours - a).abs().max()) < 1e-5


def test_ids_a_tokenizer_skips_are_suppressed(tmp_path: Path) -> None:
    """A tokenizer file whose ids have holes (no token for 5 and 6): the rows cannot be
    dropped, so generation_config.json suppresses them, and transformers never samples them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llmscale.hf.folder import write_folder
    from llmscale.model.config import get_preset
    from llmscale.model.transformer import build_model

    vocab = {ch: i for i, ch in enumerate("abcde")} | {"f": 7, "</s>": 8, "<pad>": 9}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    data = tmp_path / "data"
    data.mkdir()
    tok.save(str(data / "tokenizer.json"))
    sha = hashlib.sha256((data / "tokenizer.json").read_bytes()).hexdigest()
    meta = {"vocab_size": 10, "eos_id": 8, "pad_id": 9, "dtype": "uint16",
            "tokenizer_sha256": sha, "splits": {"train": {"tokens": 0, "shards": []}}}  # fmt: skip
    (data / "meta.json").write_text(json.dumps(meta))
    from hf_harness import run_config

    cfg = run_config(tmp_path / "run")
    cfg.data.dataset = str(data)
    rt = run_tokenizer(cfg)
    assert rt.holes() == [5, 6] and rt.encode("abf") == [0, 1, 7]
    model = get_preset("tiny").with_overrides(vocab_size=10)
    sd = build_model(model, seed=1).state_dict()
    sd["output.weight"][5:7] += 5.0  # untrained rows that would be sampled most
    out = write_folder(tmp_path / "hf", model, to_hf_state_dict(model, sd), rt.files,
                       suppress_tokens=rt.holes())  # fmt: skip
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["suppress_tokens"] == [5, 6]
    torch.manual_seed(0)
    with torch.no_grad():
        ids = hf_model(out).generate(
            torch.tensor([[0, 1]] * 8), max_new_tokens=30, do_sample=True, min_new_tokens=30
        )
    assert not set(ids[:, 2:].flatten().tolist()) & {5, 6}


def test_export_flags_from_the_command_line(
    padded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    args = ["export", str(padded_run), "--out", str(out)]
    assert main([*args, "--dtype", "bf16", "--max-shard-size", "60KB"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "vocabulary 300" in capsys.readouterr().err
    for flag, value in (("--dtype", "fp16"), ("--max-shard-size", "5XB")):
        assert main([*args, flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{flag}: got" in err, err
