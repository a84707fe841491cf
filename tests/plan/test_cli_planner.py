"""Planner commands: numbers on stdout, JSON, PNG, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmscale", *args], capture_output=True, text=True, cwd=cwd
    )


def test_hw_lists_the_catalog_and_compares_links() -> None:
    r = _run("hw")
    assert r.returncode == 0 and "h200" in r.stdout and "989.5" in r.stdout
    r = _run("hw", "--compare", "nvlink5", "pcie5")
    assert r.returncode == 0 and "14.3" in r.stdout  # 900 / 63 GB/s


def test_plan_json_and_png(tmp_path) -> None:
    png = tmp_path / "plans.png"
    r = _run("plan", "--model", "llama2-70b", "--gpu", "h200", "--gpus", "64", "--seq", "4096",
             "--global-batch", "1024", "--top", "3", "--json", "--png", str(png))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["candidates"]) == 3 and out["search"]["seconds"] < 5
    best = out["candidates"][0]
    assert (
        best["plan"]["tp"]
        * best["plan"]["pp"]
        * best["plan"]["dp_shard"]
        * best["plan"]["dp_replicate"]
        == 64
    )
    assert best["memory_bytes"]["worst_stage"]["total"] < 141 * 2**30
    assert best["fits"] is True and best["why"] is None and out["why"] is None
    assert set(best["step_time"]) >= {"seconds", "tokens_per_s", "mfu", "breakdown_seconds"}
    assert png.stat().st_size > 10_000


def test_plan_table() -> None:
    r = _run("plan", "--gpus", "64", "--top", "2")
    assert r.returncode == 0 and "MFU" in r.stdout and "llmscale train --model.name" in r.stdout


def test_roofline_says_compute_bound() -> None:
    r = _run("roofline", "--gpu", "h200", "--model", "llama2-70b")
    assert r.returncode == 0 and "training: compute-bound" in r.stdout


def test_network_table() -> None:
    r = _run("network", "--gpus", "1024", "--gpu", "h100")
    assert r.returncode == 0 and "rail-only" in r.stdout and "fat-tree" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--gpus", "64", "--gpu", "h300"], "gpu: got 'h300'"),
        (["plan", "--gpus", "64", "--model", "llama9"], "model.name: got 'llama9'"),
        (["plan", "--gpus", "0"], "gpus: got 0"),
        (["roofline", "--gpu", "nope"], "gpu: got 'nope'"),
        (["roofline", "--model", "gpt5"], "model.name"),
        (["hw", "--compare", "nvlink9", "pcie5"], "link: got 'nvlink9'"),
        (["hw", "--compare", "h200", "h300"], "gpu: got 'h300'"),
        (["network", "--gpus", "100"], "gpus: got 100"),
        (["network", "--gpus", "64", "--gpu", "tpu"], "gpu: got 'tpu'"),
        (
            ["roofline", "--precision", "int8"],
            "precision: got 'int8'; allowed: fp32 | bf16 | fp16 | fp8",
        ),
        (["plan", "--gpus", "8", "--precision", "int8"], "precision: got 'int8'"),
        (["plan", "--gpus", "8", "--json-out", "x"], "plan: error: unrecognized arguments"),
        (  # a preset's context, and how to plan a longer one
            ["plan", "--gpus", "8", "--model", "llama3-8b", "--seq", "131072"],
            "max_seq_len=8192 (a longer context: --model llama3.1-8b (131,072 tokens), or "
            '--model FILE.toml whose [model] table has name = "llama3-8b" and max_seq_len = N)',
        ),
        (["roofline", "--model", "llama3-8b", "--seq", "16384"], "max_seq_len = N"),
    ],
)
def test_bad_names_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = _run(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_stack_changes_what_is_modelled() -> None:
    """One fixed layout under each training stack: the same plan, other kernels, gathers and
    overlaps, so other predictions; an unknown stack is one line and exit 2."""
    layout = ["--tp", "8", "--pp", "1", "--dp-shard", "8", "--dp-replicate", "1", "--mbs", "1",
              "--recompute", "full", "--zero-stage", "3", "--sp", "--offload", "none"]  # fmt: skip
    base = ["plan", "--model", "llama2-70b", "--gpu", "h100", "--gpus", "64", "--seq", "4096",
            "--global-batch", "512", "--json", *layout]  # fmt: skip
    got = {}
    for stack in ("llmscale", "megatron-2021", "megatron-core", "torchtitan"):
        r = _run(*base, "--stack", stack)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["inputs"]["stack"] == stack
        (c,) = out["candidates"]
        got[stack] = (c["step_time"]["seconds"], c["memory_bytes"]["worst_stage"]["total"])
    assert len(set(got.values())) == 4
    r = _run(*base, "--stack", "deepspeed")
    assert r.returncode == 2 and "deepspeed" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_stack_refuses_a_recompute_policy_it_cannot_run() -> None:
    """`selective` is the attention core in every stack; torchtitan's selective AC is op SAC,
    so it refuses `selective` naming its own equivalent."""
    base = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--seq", "4096",
            "--global-batch", "64", "--json", "--stack", "torchtitan"]  # fmt: skip
    r = _run(*base, "--recompute", "selective")
    assert r.returncode == 2 and "selective_op" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert _run(*base, "--recompute", "selective_op").returncode == 0


def test_a_stack_runs_only_its_own_optimizer_offload() -> None:
    """Each stack plans only the optimizer offload it runs (`Stack.offloads`): torchtitan's CPU
    offload is FSDP2's CPUOffloadPolicy ("optimizer+params"), Megatron-Core's the hybrid-device
    optimizer ("optimizer"); a mode fixed by a flag that the stack lacks is one line naming its
    own, and the search leaves it out."""
    base = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--seq", "8192",
            "--global-batch", "512", "--json", "--top", "20"]  # fmt: skip
    for stack, lacks, own in (
        ("torchtitan", "optimizer", "--training.enable_cpu_offload"),
        ("megatron-core", "optimizer+params", "--optimizer-cpu-offload"),
        ("megatron-2021", "optimizer", "none under --stack megatron-2021"),
    ):
        r = _run(*base, "--stack", stack, "--offload", lacks)
        assert r.returncode == 2 and own in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    runs = {"torchtitan": {"none", "optimizer+params"}, "megatron-core": {"none", "optimizer"}}
    for stack, allowed in runs.items():
        r = _run(*base, "--stack", stack)
        assert r.returncode == 0, r.stderr
        seen = {c["plan"]["offload"] for c in json.loads(r.stdout)["candidates"]}
        assert seen <= allowed, (stack, seen)
    job = ["train", "--model.name", "llama3-8b", "--parallel.dp_shard", "8",
           "--optimizer.offload", "optimizer", "--train.global_batch_size", "64",
           "--data.seq_len", "4096", "--dry-run", "--gpu", "h100", "--stack", "torchtitan"]  # fmt: skip
    r = _run(*job)
    assert r.returncode == 2 and "optimizer.offload" in r.stderr, r.stderr


def test_train_dry_run_and_bench_take_a_stack() -> None:
    """`train --dry-run --gpu NAME --stack NAME` predicts the job under that stack's rules; a
    policy the stack lacks is one line; `train` itself runs llmscale only; `bench --what
    published --stack NAME` keeps that stack's rows."""
    job = ["train", "--model.name", "llama3-8b", "--parallel.dp_shard", "8",
           "--parallel.zero_stage", "1", "--train.micro_batch_size", "1",
           "--train.global_batch_size", "64", "--data.seq_len", "4096", "--dry-run",
           "--gpu", "h100"]  # fmt: skip
    r = _run(*job, "--stack", "megatron-core")
    assert r.returncode == 0, r.stderr
    assert "--stack megatron-core" in r.stdout and "step time:" in r.stdout
    r = _run(*job, "--stack", "torchtitan", "--train.recompute", "selective")
    assert r.returncode == 2 and "selective_op" in r.stderr
    r = _run("train", "--stack", "torchtitan")
    assert r.returncode == 2 and "--dry-run" in r.stderr
    r = _run("bench", "--what", "published", "--stack", "torchtitan")
    assert r.returncode == 0, r.stderr
    assert "torchtitan:" in r.stdout and "megatron-core:" not in r.stdout


def test_plan_infer_roofline_and_dry_run_take_a_model_file_or_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--model NAME | FILE.toml | DIR: a custom [model] table and a Hugging Face folder's
    config.json; the best plan's train command carries the shape; a bad file is one line."""
    toml = tmp_path / "my-model.toml"
    toml.write_text(
        "[model]\nvocab_size = 50304\ndim = 2048\nn_layers = 24\nn_heads = 16\n"
        "n_kv_heads = 4\nffn_dim = 5632\nmax_seq_len = 4096\n"
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }))  # fmt: skip
    for spec in (str(toml), str(hf)):
        r = _run("plan", "--model", spec, "--gpu", "h100", "--gpus", "8", "--seq", "4096",
                 "--global-batch", "64", "--top", "1", "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        (c,) = json.loads(r.stdout)["candidates"]
        assert "--model.dim" in c["overrides"] and c["fits"]
        assert _run("roofline", "--model", spec).returncode == 0
        r = _run("infer", "--model", spec, "--gpu", "h100", "--gpus", "1", "--input-len", "256",
                 "--output-len", "16")  # fmt: skip
        assert r.returncode == 0, r.stderr
    r = _run("train", "--model", str(hf), "--dry-run", "--gpu", "h100", "--data.seq_len", "1024")
    assert r.returncode == 0 and "model custom" in r.stdout, r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndim = 64\n")
    r = _run("plan", "--model", str(bad), "--gpus", "8")
    assert r.returncode == 2 and "vocab_size" in r.stderr and len(r.stderr.splitlines()) == 1
    assert "FILE.toml" in _run("plan", "--help").stdout


def test_the_headline_names_the_values_fitted_on_published_runs() -> None:
    """A plan priced with values fitted on published runs says which (`stack.fitted_note`): the
    stack's factor on that GPU and its block-scaled recipe's GEMM share; a plan priced with the
    catalog's rates alone says nothing of the kind."""
    from llmscale.stack import LLMSCALE, MEGATRON_CORE, MEGATRON_CORE_MXFP8, fitted_note

    note = fitted_note(MEGATRON_CORE, "gb200", "fp8", "mxfp8")
    fit = next(f for f in MEGATRON_CORE.fitted if f.gpu == "gb200")
    assert note is not None and f"SM rates x{fit.scale.value:g}" in note
    assert f"mxfp8 GEMMs x{MEGATRON_CORE_MXFP8.value:g}" in note
    assert "mxfp8" not in (fitted_note(MEGATRON_CORE, "gb200", "fp8", "tensorwise") or "")
    assert fitted_note(MEGATRON_CORE, "h100", "fp8", "tensorwise") is None
    assert fitted_note(LLMSCALE, "gb200", "bf16", "tensorwise") is None
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--global-batch",
            "128", "--top", "1"]  # fmt: skip
    r = _run(*base, "--gpu", "gb200", "--stack", "megatron-core", "--precision", "fp8",
             "--float8-recipe", "mxfp8")  # fmt: skip
    assert r.returncode == 0 and "fitted to published runs: megatron-core on gb200" in r.stdout
    r = _run(*base, "--gpu", "gb200", "--stack", "megatron-core", "--precision", "fp8",
             "--float8-recipe", "mxfp8", "--json")  # fmt: skip
    fitted = {f["scales"]: f for f in json.loads(r.stdout)["fitted"]}
    assert fitted["SM rates"]["value"] == fit.scale.value
    assert fitted["mxfp8 GEMMs"]["source"] == MEGATRON_CORE_MXFP8.source
    r = _run(*base, "--gpu", "h100")
    assert r.returncode == 0 and "fitted to published runs" not in r.stdout
    r = _run(*base, "--gpu", "h100", "--json")
    assert json.loads(r.stdout)["fitted"] == []
    job = ["train", "--dry-run", "--gpu", "gb200", "--stack", "megatron-core", "--model.name",
           "llama3-8b", "--parallel.dp_shard", "8", "--train.global_batch_size", "64"]  # fmt: skip
    r = _run(*job)
    assert r.returncode == 0 and "fitted to published runs: megatron-core on gb200" in r.stdout
