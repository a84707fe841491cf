"""Bad input from the review (../shared/reviews/usability-and-faults.md), each case run through the
command line as a user would: exit 2, one line on stderr naming the flag or field, the value and
what is allowed, found before any work, and nothing written or lost. Each case is a row of
docs/reliability.md (the fault_row fixture).

In-process (llmscale.cli.main) where the case allows it; the two permission cases need a process
without CAP_DAC_OVERRIDE (as root: setpriv drops it), so they run as a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here, so a case's time is its own, not torch's import)

from llmscale.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"
METRICS = (
    '{"kind": "train", "step": 1, "loss": 5.5, "tokens_per_s": 100.0}\n'
    '{"kind": "train", "step": 2, "loss": "nan", "tokens_per_s": 90.0}\n'
)


def run_cli(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `llmscale ARGS` run in this process; any exception other
    than SystemExit propagates, so a traceback fails the test."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_exit_2(rc: int, err: str, needle: str) -> str:
    """The stderr line, after checking the contract: exit 2, one line, naming `needle`."""
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]
    return lines[0]


def observed(rc: int, line: str) -> str:
    return f"exit {rc}: {line}"


def digest(folder: Path) -> dict[str, str]:
    """Every file under folder with its content hash: what a case must leave as it found it."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def lost(before: dict[str, str], after: dict[str, str]) -> str:
    changed = [k for k in before if after.get(k) != before[k]]
    return "none" if not changed else "changed: " + ", ".join(changed)


# ---- cases that stop at validation: (id, fault, setup(tmp) -> args, field named) ----------


def _bad_utf8(tmp: Path) -> list[str]:
    (tmp / "bad.toml").write_bytes(b"\xff\xfe[train]\n")
    return ["train", "--config", str(tmp / "bad.toml")]


def _run_dir_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["train", "--job.run_dir", str(tmp / "afile")]


def _run_dir_under_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["train", "--job.run_dir", str(tmp / "afile" / "run")]


def _empty_corpus(tmp: Path) -> list[str]:
    (tmp / "corpus").mkdir()
    return ["train", "--data.path", str(tmp / "corpus"), "--job.run_dir", str(tmp / "run")]


def _glob_nothing(tmp: Path) -> list[str]:
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("hello world " * 100)
    return [
        "train", "--data.path", str(tmp / "corpus"), "--data.glob", "*.md",
        "--job.run_dir", str(tmp / "run"),
    ]  # fmt: skip


def _empty_files(tmp: Path) -> list[str]:
    (tmp / "corpus").mkdir()
    for i in range(3):
        (tmp / "corpus" / f"{i}.py").write_text("")
    return ["train", "--data.path", str(tmp / "corpus"), "--job.run_dir", str(tmp / "run")]


def _metrics_run(tmp: Path, text: str) -> Path:
    run = tmp / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text(text)
    return run


def _plot_bad_line(tmp: Path) -> list[str]:
    run = _metrics_run(tmp, METRICS.replace('{"kind": "train", "step": 2', '{bad, "step": 2'))
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + METRICS)
    return ["plot", str(run)]


def _plot_empty(tmp: Path) -> list[str]:
    return ["plot", str(_metrics_run(tmp, ""))]


def _plot_out_proc(tmp: Path) -> list[str]:
    return ["plot", str(_metrics_run(tmp, METRICS)), "--out", "/proc/llmscale-x.png"]


def _plot_out_folder(tmp: Path) -> list[str]:
    return ["plot", str(_metrics_run(tmp, METRICS)), "--out", str(tmp)]


def _plot_out_suffix(tmp: Path) -> list[str]:
    return ["plot", str(_metrics_run(tmp, METRICS)), "--out", str(tmp / "loss.v1")]


def _timeline_run(tmp: Path, text: str) -> Path:
    run = tmp / "run"
    run.mkdir(exist_ok=True)
    (run / "timeline-rank0.json").write_text(text)
    return run


def _timeline_damaged(tmp: Path) -> list[str]:
    return [
        "plot",
        str(_timeline_run(tmp, '{"device": "cpu", "intervals": [{"step": ')),
        "--timeline",
    ]


def _timeline_step(tmp: Path) -> list[str]:
    ivs = [
        {"step": s, "unit": "u0", "phase": ph, "lane": lane, "start": s + a, "end": s + a + 0.1}
        for s in (2, 3, 4)
        for ph, lane, a in (("forward", "compute", 0.0), ("update", "cpu", 0.5))
    ]
    run = _timeline_run(tmp, json.dumps({"device": "cpu", "intervals": ivs}))
    return ["plot", str(run), "--timeline", "--step", "99"]


def _schedule_png_folder(tmp: Path) -> list[str]:
    return ["schedule", "--png", str(tmp)]


def _plan_png_proc(tmp: Path) -> list[str]:
    return ["plan", "--gpus", "8", "--png", "/proc/llmscale-x.png"]


def _bench_json_out(tmp: Path) -> list[str]:
    return ["bench", "--what", "accum", "--json-out", "/proc/llmscale-nope.json"]


def _bench_markdown(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["bench", "--what", "memory", "--markdown", str(tmp / "afile" / "results.md")]


def _bench_png(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["bench", "--what", "memory", "--png", str(tmp / "afile")]


def _plain(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: list(args)


CASES: list[tuple[str, str, Callable[[Path], list[str]], str]] = [
    ("C09", "config file that is not UTF-8", _bad_utf8, "--config"),
    ("C11", "--config is a folder", _plain("train", "--config", "/tmp"), "--config"),
    ("C16", "--steps instead of --train.steps", _plain("train", "--steps", "3"), "--train.steps"),
    (
        "C28",
        "train.steps beyond 64 bits",
        _plain("train", "--train.steps", "99999999999999999999999"),
        "train.steps",
    ),
    (
        "C33",
        "model.vocab_size below the byte vocabulary",
        _plain("train", "--model.vocab_size", "100"),
        "model.vocab_size",
    ),
    (
        "C30",
        "model.dim reshaped past this host's memory",
        _plain("train", "--model.dim", "65536"),
        "tiny with dim=65536",
    ),
    ("R01", "job.run_dir is a file", _run_dir_file, "job.run_dir"),
    ("R01b", "job.run_dir under a file", _run_dir_under_file, "job.run_dir"),
    ("D02", "corpus folder with no files", _empty_corpus, "data.glob"),
    ("D11", "data.glob matches nothing", _glob_nothing, "data.glob"),
    ("D13", "corpus of empty files", _empty_files, "data.path"),
    ("Q01", "plot of a missing folder", lambda tmp: ["plot", str(tmp / "nope")], "run_dir"),
    ("Q02", "plot of a folder without metrics.jsonl", lambda tmp: ["plot", str(tmp)], "run_dir"),
    ("Q03", "metrics.jsonl with a bad line", _plot_bad_line, "metrics.jsonl line 2"),
    ("Q04", "empty metrics.jsonl", _plot_empty, "run_dir"),
    ("Q08b", "plot --timeline of a damaged timeline file", _timeline_damaged, "not a timeline"),
    # 1-based on the command line, 1-based in the message: steps 3, 4, 5 are kept.
    ("Q11", "plot --timeline --step beyond the kept steps", _timeline_step, "[99] not in"),
    ("Q10", "plot --out where nothing can be written", _plot_out_proc, "--out"),
    ("Q10b", "plot --out is a folder", _plot_out_folder, "--out"),
    ("Q10c", "plot --out with no image suffix matplotlib knows", _plot_out_suffix, "--out"),
    (
        "S-int",
        "schedule --schedule interleaved without --chunks",
        _plain("schedule", "--schedule", "interleaved"),
        "--chunks",
    ),
    ("S13", "schedule --png is a folder", _schedule_png_folder, "--png"),
    (
        "S-width",
        "schedule --width 10^12 (found by the fuzz test: a MemoryError)",
        _plain("schedule", "--width", "1000000000000", "--t-fwd", "1e-9"),
        "width",
    ),
    ("H08", "roofline --seq 0", _plain("roofline", "--seq", "0"), "seq"),
    ("N06", "network --a2a-mb -5", _plain("network", "--gpus", "64", "--a2a-mb", "-5"), "a2a_mb"),
    ("N09", "network --a2a-mb nan", _plain("network", "--gpus", "64", "--a2a-mb", "nan"), "a2a_mb"),
    (
        "N07",
        "network --global-batch 0",
        _plain("network", "--gpus", "64", "--global-batch", "0"),
        "global_batch",
    ),
    (
        "P15",
        "plan with another GPU's node shape",
        _plain("plan", "--gpus", "8", "--gpu", "h100", "--node", "mi300x-platform"),
        "node",
    ),
    ("P14b", "plan --png where nothing can be written", _plan_png_proc, "--png"),
    ("B07", "bench --json-out to an unwritable path", _bench_json_out, "--json-out"),
    ("B07b", "bench --markdown under a file", _bench_markdown, "--markdown"),
    ("B07c", "bench --png is a file", _bench_png, "--png"),
]


@pytest.mark.parametrize(("case", "fault", "setup", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_work(
    case: str,
    fault: str,
    setup: Callable[[Path], list[str]],
    field: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault_row: Callable[..., None],
) -> None:
    monkeypatch.chdir(tmp_path)  # the default run folder, if any, would land here
    work = tmp_path / "work"
    work.mkdir()
    args = setup(work)
    before = digest(tmp_path)
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, args)
    seconds = time.perf_counter() - t0
    line = one_line_exit_2(rc, err, field)
    after = digest(tmp_path)
    assert set(after) == set(before), "a failed command wrote files"
    assert not (tmp_path / "runs").exists()
    # Before the work: no model built, no benchmark run (the review's bench case took 113 s).
    assert seconds < 15, seconds
    fault_row(
        fault=f"{case}: {fault}",
        command="llmscale " + " ".join(a.replace(str(work), "DIR") for a in args),
        expected="exit 2, one line naming the field, before any work",
        observed=observed(rc, line.replace(str(work), "DIR")) + f" ({seconds:.1f} s)",
        data_lost=lost(before, after),
    )


# ---- permissions: a process that cannot override file modes -------------------------------


def _unprivileged(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file modes do not apply")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]


def _run_unprivileged(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = _unprivileged([sys.executable, "-m", "llmscale", *args])
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.fixture
def open_tmp() -> Path:
    """A folder an unprivileged process can reach (pytest's tmp_path is under a 0700 folder)."""
    d = Path(tempfile.mkdtemp(prefix="llmscale-faults-"))
    d.chmod(0o755)
    yield d
    for p in [d, *d.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(d)


def test_run_dir_under_a_read_only_folder(open_tmp: Path, fault_row: Callable[..., None]) -> None:
    ro = open_tmp / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    args = ["train", "--job.run_dir", str(ro / "run"), "--train.steps", "1"]
    r = _run_unprivileged(args, open_tmp)
    line = one_line_exit_2(r.returncode, r.stderr, "job.run_dir")
    assert "Permission denied" in line
    assert list(ro.iterdir()) == []
    fault_row(
        fault="R02: job.run_dir under a read-only folder (no CAP_DAC_OVERRIDE)",
        command="llmscale " + " ".join(args).replace(str(open_tmp), "DIR"),
        expected="exit 2, one line naming job.run_dir, before the model is built",
        observed=observed(r.returncode, line.replace(str(open_tmp), "DIR")),
        data_lost="none",
    )


@pytest.mark.slow
def test_unreadable_corpus_file(open_tmp: Path, fault_row: Callable[..., None]) -> None:
    corpus = open_tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("print('hello')\n" * 200)
    (corpus / "b.py").write_text("x = 1\n" * 200)
    (corpus / "b.py").chmod(0)
    args = [
        "train", "--data.path", str(corpus), "--job.run_dir", str(open_tmp / "run"),
        "--train.steps", "1", "--data.seq_len", "32", "--metrics.progress", "false",
    ]  # fmt: skip
    r = _run_unprivileged(args, open_tmp)
    line = one_line_exit_2(r.returncode, r.stderr, "data.path")
    assert "b.py" in line and "Permission denied" in line
    assert not (open_tmp / "run" / "checkpoints").exists()
    fault_row(
        fault="D04: a corpus file that cannot be read (mode 000, no CAP_DAC_OVERRIDE)",
        command="llmscale " + " ".join(args).replace(str(open_tmp), "DIR"),
        expected="exit 2, one line naming data.path and the file, before the model is built",
        observed=observed(r.returncode, line.replace(str(open_tmp), "DIR")),
        data_lost="none",
    )


# ---- accepted, but no longer silent or misleading -----------------------------------------


def test_version(capsys: pytest.CaptureFixture[str], fault_row: Callable[..., None]) -> None:
    from llmscale import __version__

    rc, out, err = run_cli(capsys, ["--version"])
    assert rc == 0 and out.strip() == f"llmscale {__version__}" and not err
    fault_row(
        fault="llmscale --version",
        command="llmscale --version",
        expected="exit 0, the version",
        observed=f"exit {rc}: {out.strip()}",
    )


def test_plot_of_a_nan_loss_is_numeric(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault_row: Callable[..., None],
) -> None:
    """metrics.jsonl writes nan as a string; the plot must not turn the axis into categories."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = _metrics_run(tmp_path, METRICS)
    drawn: list[list[float]] = []
    real_savefig = plt.Figure.savefig

    def spy(fig: plt.Figure, *a: object, **k: object) -> None:
        drawn.extend([list(map(float, line.get_ydata())) for line in fig.axes[0].lines])
        real_savefig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    rc, out, err = run_cli(capsys, ["plot", str(run)])
    assert rc == 0, err
    assert drawn[0][0] == 5.5 and drawn[0][1] != drawn[0][1]  # 5.5 then a NaN gap
    fault_row(
        fault="Q07: plot of a run whose loss became NaN",
        command="llmscale plot RUN",
        expected="exit 0; a numeric loss axis, the NaN step a gap",
        observed=f"exit {rc}; train loss drawn as {drawn[0]}",
    )


def test_schedule_png_without_suffix_names_the_file_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault_row: Callable[..., None]
) -> None:
    rc, out, err = run_cli(capsys, ["schedule", "--png", str(tmp_path / "gantt")])
    assert rc == 0, err
    written = out.strip().splitlines()[-1]
    assert written == f"wrote {tmp_path / 'gantt.png'}" and (tmp_path / "gantt.png").is_file()
    fault_row(
        fault="S13b: schedule --png without a suffix",
        command="llmscale schedule --png DIR/gantt",
        expected="exit 0, names the file it wrote",
        observed=f"exit {rc}: {written.replace(str(tmp_path), 'DIR')}",
    )


def test_bench_that_cannot_fit_leaves_no_temporary_folder(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault_row: Callable[..., None],
) -> None:
    """The review found an empty /tmp/llmscale-bench-* after every bench, error exits included;
    and the memory check's advice named --job.memory_check, which bench does not take."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc, _, err = run_cli(capsys, ["bench", "--model", "llama2-70b", "--what", "memory"])
    line = one_line_exit_2(rc, err, "cannot fit")
    assert "--job.memory_check" not in line and "--model" in line
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [], left
    fault_row(
        fault="B03/D17: bench of a model that cannot fit; its temporary folder",
        command="llmscale bench --model llama2-70b --what memory",
        expected="exit 2, one line with advice bench takes; no /tmp/llmscale-bench-* left",
        observed=observed(rc, line) + f"; temporary folders left: {len(left)}",
    )


def test_corpus_warnings_are_printed(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fault_row: Callable[..., None],
) -> None:
    """A corpus of one binary file: trained on (bytes are tokens), but the user is told it looks
    binary and that there is no validation split."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "blob.py").write_bytes(bytes(range(256)) * 40)
    args = [
        "train", "--data.path", str(corpus), "--data.seq_len", "32", "--train.steps", "1",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
        "--checkpoint.enabled", "false", "--metrics.progress", "false",
        "--job.run_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    rc, out, err = run_cli(capsys, args)
    assert rc == 0, err
    warned = [ln for ln in out.splitlines() if ln.startswith("data: ") and "train /" not in ln]
    assert any("look binary" in w for w in warned), out
    assert any("no validation loss" in w for w in warned), out
    fault_row(
        fault="D03/D09: a corpus of one binary file (no validation split)",
        command="llmscale train --data.path DIR",
        expected="exit 0 (bytes are tokens), with a warning for each",
        observed=f"exit {rc}; " + " | ".join(w.replace(str(tmp_path), "DIR") for w in warned),
    )


@pytest.mark.parametrize(
    "args",
    [
        ["network", "--gpus", "64", "--global-batch", "1000000"],
        ["plan", "--gpus", "64", "--global-batch", "1000000", "--top", "1"],
    ],
    ids=["network", "plan"],
)
def test_a_huge_global_batch_is_answered_quickly(
    args: list[str], capsys: pytest.CaptureFixture[str], fault_row: Callable[..., None]
) -> None:
    """Found by tests/faults/test_fuzz_cli.py: a global batch of 10^6 sequences made the planner
    simulate every micro-batch of a pipeline step (minutes, then 24 GB and the OOM killer)."""
    t0 = time.perf_counter()
    rc, out, err = run_cli(capsys, args)
    seconds = time.perf_counter() - t0
    assert rc == 0, err
    assert seconds < 30, seconds
    fault_row(
        fault=f"{args[0]} with a global batch of 10^6 sequences",
        command="llmscale " + " ".join(args),
        expected="exit 0 within seconds (the pipeline's closed form, not a simulation)",
        observed=f"exit {rc} in {seconds:.1f} s",
    )
