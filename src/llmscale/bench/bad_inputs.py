"""The usability review's bad-input sweep, re-run: every case of its per-case tables, classified.

    python bench/bad_inputs.py [--review FILE] [--only ID,PREFIX*] [--new] [--out results.json]

Reads the review (../shared/reviews/usability-2026-12-04.md by default): the `id | command |
rc | class ...` rows of its "Per-case results" tables, the "before ID: `setup`" steps and the
two fixture scripts of its Appendix. In a fresh folder (--work, a temporary one by default) it
builds the base fixtures the review names (fixtures/ck, runs/demo, hf/demo, the prepared
datasets fixtures/ds_bytes and ds_bpe, fixtures/run_bpe, hf/mine, data/mine, runs/flipped2|3
and a few work/ files), runs the Appendix scripts, then each case as the review did: `bash -c COMMAND`
from that folder, stdin from /dev/null, with F, RD (a fresh runs-test/ID), TB, TBNS and
LLMSCALE_CACHE_DIR=work/cache set, and a per-case timeout (--timeout for commands that train,
--cli-timeout for the others).

Classes: `traceback` (a Python traceback in the output; `tr-traceback` when it is torchrun's,
after a bare `torchrun` command), `hang` (timed out), `clean` (exit 2, one line), `ok`
(exit 0), `rc N` (another exit code, no traceback). "Silent" (accepted though wrong) needs a
reader: the cases the review called silent are listed with their new first line. Prints totals
(all, the 153 old, the 280 new) and every traceback with its last line; --out writes each case's
record (command, rc, class, wall, the review's class, the output's tail) as JSON.

The Appendix does not say how every fixture was built; where it does not, this script makes the
closest one it can (the runs are short: 4 steps instead of the demo's 50), and says so here:
runs/demo is one process of the default config, 4 steps, checkpoints at 2 and 4; hf/demo its
export; fixtures/run_bpe 4 steps on ds_bpe; hf/mine that run's export; data/mine (DS23) the
stdlib json package prepared as the review's walk-through did; work/cache_* copies of
work/cache that are a file, garbage JSON, read-only, and figures set to -1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/llmscale/bench/ -> root)
REVIEW = ROOT.parent / "shared" / "reviews" / "usability-2026-12-04.md"
PYTHON = sys.executable
TB = "--train.steps 3 --metrics.progress false --data.max_files 40 --train.eval_sequences 4"
TBNS = "--metrics.progress false --data.max_files 40 --train.eval_sequences 4"
FAST = "--metrics.progress false --data.max_files 40 --train.eval_sequences 4"
STDLIB = Path(os.__file__).parent


@dataclass
class Case:
    id: str
    group: str
    new: bool  # one of the review's 280 new cases (else one of the 153 re-run)
    command: str
    review_rc: str
    review_class: str


@dataclass
class Result:
    id: str
    group: str
    new: bool
    command: str
    rc: int | None
    cls: str
    wall_s: float
    review_class: str
    first_line: str
    tail: str


def _cells(row: str) -> list[str]:
    """A markdown table row's cells (`\\|` inside a cell is a literal bar)."""
    parts = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [p.strip() for p in parts]


def _code(cell: str) -> str:
    """The command inside a cell's backticks, with the table's escapes undone."""
    m = re.search(r"`(.*)`", cell)
    text = m.group(1) if m else cell
    return text.replace("\\\\|", "|").replace("\\|", "|")


def parse_cases(text: str) -> list[Case]:
    cases: list[Case] = []
    new, group, inside = False, "", False
    for line in text.splitlines():
        if line.startswith("### Per-case results"):
            inside, new = True, "new" in line
            continue
        if line.startswith("## Appendix"):
            break
        if not inside:
            continue
        if line.startswith("#### "):
            group = line[5:].strip()
            continue
        if not line.startswith("| ") or line.startswith("| id ") or line.startswith("|---"):
            continue
        cells = _cells(line)
        if len(cells) < 4 or "`" not in cells[1]:
            continue
        cls = cells[3].replace("*", "").strip()
        cases.append(Case(cells[0], group, new, _code(cells[1]), cells[2], cls))
    return cases


def parse_setups(text: str) -> dict[str, str]:
    """The Appendix's `- before ID: `command`` steps."""
    out = {}
    for m in re.finditer(r"^- before (\S+): `(.*)`\s*$", text, re.M):
        out[m.group(1)] = m.group(2)
    return out


def parse_scripts(text: str) -> list[str]:
    appendix = text[text.index("## Appendix") :]
    return re.findall(r"```sh\n(.*?)```", appendix, re.S)


# ---- fixtures ----------------------------------------------------------------------------------
def _sh(cmd: str, cwd: Path, env: dict[str, str], timeout: float = 900) -> None:
    p = subprocess.run(
        ["bash", "-c", cmd],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-2000:]
        raise SystemExit(f"fixture step failed (rc {p.returncode}): {cmd}\n{tail}")


def _xor(path: Path, positions: range, mask: int) -> None:
    b = bytearray(path.read_bytes())
    for i in positions:
        if i < len(b):
            b[i] ^= mask
    path.write_bytes(bytes(b))


def build_fixtures(w: Path, env: dict[str, str], scripts: list[str]) -> None:
    for d in ("work/cache", "runs-test", "fixtures/toml", "fixtures/corp", "fixtures/dp"):
        (w / d).mkdir(parents=True, exist_ok=True)
    (w / "configs").symlink_to(ROOT / "configs")
    home = Path.home() / ".cache" / "llmscale"
    if home.is_dir():  # the calibrations already measured on this machine (else each remeasures)
        for p in home.glob("calibration-*.json"):
            shutil.copy(p, w / "work" / "cache")
    email = STDLIB / "email"
    steps = [
        f"llmscale train --train.steps 4 --checkpoint.interval 2 --checkpoint.keep_last 3 "
        f"--job.run_dir fixtures/ck {FAST}",
        f"llmscale train --train.steps 4 --checkpoint.interval 2 --job.run_dir runs/demo {FAST}",
        "llmscale export runs/demo --format hf --out hf/demo",
        f"llmscale data prepare --input {email} --out fixtures/ds_bytes --val-fraction 0.2",
        f"llmscale data prepare --input {email} --tokenizer bpe --vocab-size 512 "
        "--out fixtures/ds_bpe --val-fraction 0.2",
        f"llmscale train --train.steps 4 --checkpoint.interval 2 --data.dataset fixtures/ds_bpe "
        f"--job.run_dir fixtures/run_bpe {FAST}",
        "llmscale export fixtures/run_bpe --format hf --out hf/mine",
        # DS23's data/mine: the README walk-through's `data prepare` of my_texts/, which held
        # the stdlib json package (5 documents, all hashed into train at --val-fraction 0.05).
        f"cp -r {STDLIB / 'json'} my_texts && rm -rf my_texts/__pycache__ && llmscale data "
        "prepare --input my_texts/ --tokenizer bpe --vocab-size 8192 --out data/mine",
    ]
    for cmd in steps:
        print(f"fixture: {cmd}", flush=True)
        _sh(cmd, w, env)
    runs = w / "fixtures" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for name, positions, mask in (
        ("flipped2", range(300_000, 300_400), 0xFF),
        ("flipped3", range(0, 1 << 40, 4096), 0x40),
    ):
        shutil.copytree(w / "fixtures" / "ck", runs / name, symlinks=True)
        shard = runs / name / "checkpoints" / "step-000004" / "__0_0.distcp"
        size = shard.stat().st_size
        _xor(shard, range(positions.start, min(positions.stop, size), positions.step), mask)
    # The scripts ran from the repository root with `cd fixtures`, and also name fixtures/ck
    # and ./hf/demo from inside it.
    (w / "fixtures" / "fixtures").symlink_to(".")
    (w / "fixtures" / "hf").mkdir(exist_ok=True)
    shutil.copytree(w / "hf" / "demo", w / "fixtures" / "hf" / "demo")
    for script in scripts:
        script = script.replace("/root/.pyenv/versions/3.11.7/lib/python3.11", str(STDLIB))
        _sh(script, w, env)
    work = w / "work"
    (work / "exp_exists").mkdir()
    (work / "exp_exists" / "keep.txt").write_text("keep\n")
    (work / "exp_file").write_text("a file\n")
    (work / "pngdir").mkdir()
    (work / "cache_file").write_text("not a folder\n")
    for name in ("cache_bad", "cache_ro", "cache_trunc"):
        shutil.copytree(work / "cache", work / name)
    for p in (work / "cache_bad").glob("*.json"):
        p.write_text("{garbage")
    for p in (work / "cache_trunc").glob("*.json"):
        p.write_text(re.sub(r"(?<=: )\d+\.?\d*(e-?\d+)?", "-1", p.read_text()))
    os.chmod(work / "cache_ro", 0o555)


# ---- running and classifying -------------------------------------------------------------------
def trains(command: str) -> bool:
    return (" train" in command or "torchrun" in command) and "--dry-run" not in command


def classify(command: str, rc: int | None, out: str) -> str:
    if rc is None:
        return "hang"
    if "Traceback (most recent call last)" in out:
        torchrun = command.lstrip().startswith("torchrun") or "ChildFailedError" in out
        return "tr-traceback" if torchrun and "ChildFailedError" in out else "traceback"
    if rc == 0:
        return "ok"
    if rc == 2:
        lines = [x for x in out.splitlines() if x.strip()]
        return "clean" if len(lines) == 1 else f"rc 2, {len(lines)} lines"
    return f"rc {rc}"


def first_line(out: str) -> str:
    for line in out.splitlines():
        s = line.strip()
        if s and not s.startswith("fixture"):
            return s[:240]
    return ""


def run_case(case: Case, w: Path, env: dict[str, str], setup: str | None, t: float) -> Result:
    rd = f"runs-test/{case.id}"
    env = dict(env, RD=rd)
    if setup:
        subprocess.run(
            ["bash", "-c", setup], cwd=w, env=env, stdin=subprocess.DEVNULL, check=False,
            capture_output=True, timeout=300,
        )  # fmt: skip
    start = time.monotonic()
    p = subprocess.Popen(
        ["bash", "-c", case.command],
        cwd=w,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        raw, _ = p.communicate(timeout=t)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raw, _ = p.communicate()
        rc = None
    wall = time.monotonic() - start
    out = raw.decode("utf-8", "replace")
    return Result(
        id=case.id,
        group=case.group,
        new=case.new,
        command=case.command,
        rc=rc,
        cls=classify(case.command, rc, out),
        wall_s=round(wall, 1),
        review_class=case.review_class,
        first_line=first_line(out),
        tail=out[-3000:],
    )


def _selected(cases: list[Case], only: str | None, new_only: bool) -> list[Case]:
    if new_only:
        cases = [c for c in cases if c.new]
    if only:
        keys = [k.strip() for k in only.split(",") if k.strip()]
        cases = [
            c
            for c in cases
            if any(c.id == k or (k.endswith("*") and c.id.startswith(k[:-1])) for k in keys)
        ]
    return cases


def summary(results: list[Result]) -> str:
    lines = []
    order = ["clean", "ok", "traceback", "tr-traceback", "hang"]
    for title, rows in (
        ("all", results),
        ("old 153", [r for r in results if not r.new]),
        ("new 280", [r for r in results if r.new]),
    ):
        if not rows:
            continue
        n = Counter(r.cls for r in rows)
        others = sorted(k for k in n if k not in order)
        parts = [f"{k} {n[k]}" for k in order + others if n[k]]
        lines.append(f"{title} ({len(rows)}): " + ", ".join(parts))
    bad = [r for r in results if r.cls in ("traceback", "hang")]
    if bad:
        lines.append(f"tracebacks and hangs ({len(bad)}):")
        for r in bad:
            last = [x for x in r.tail.splitlines() if x.strip()]
            lines.append(f"  {r.id} [{r.cls}] {r.command[:120]}")
            lines.append(f"      -> {last[-1][:200] if last else ''}")
    silent = [r for r in results if "silent" in r.review_class]
    if silent:
        lines.append(f"the review's silent cases ({len(silent)}), for a reader to judge:")
        for r in silent:
            lines.append(f"  {r.id} {r.cls} rc {r.rc}: {r.first_line[:160]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmscale.bench.bad_inputs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--review", type=Path, default=REVIEW)
    ap.add_argument("--only", help="case ids, comma-separated; PREFIX* for a group (DS*)")
    ap.add_argument("--new", action="store_true", help="only the review's 280 new cases")
    ap.add_argument("--work", type=Path, help="folder for fixtures and runs (default: a temp one)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds, commands that train")
    ap.add_argument("--cli-timeout", type=float, default=90, help="seconds, other commands")
    ap.add_argument("--out", type=Path, help="write every case's record here (JSON)")
    args = ap.parse_args(argv)
    if not args.review.is_file():
        print(f"--review: no such file {args.review}", file=sys.stderr)
        return 2
    text = args.review.read_text()
    every = parse_cases(text)
    cases = _selected(every, args.only, args.new)
    setups = parse_setups(text)
    for sid in [k for k in setups if k not in {c.id for c in every}]:
        # A setup of no case (K00: the copies K01..K12 start from) runs before the first case
        # of its group (same letters), ahead of that case's own setup.
        letters = re.match(r"[A-Z_]*", sid).group(0)  # type: ignore[union-attr]
        first = next((c.id for c in cases if re.match(r"[A-Z_]*", c.id).group(0) == letters), None)  # type: ignore[union-attr]
        if first is not None:
            setups[first] = setups.pop(sid) + (f" && {setups[first]}" if first in setups else "")
    w = args.work or Path(tempfile.mkdtemp(prefix="llmscale-bad-inputs-"))
    w = w.resolve()
    w.mkdir(parents=True, exist_ok=True)
    bin_dir = w / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "llmscale"
    wrapper.write_text(f'#!/bin/sh\nexec {PYTHON} -m llmscale "$@"\n')
    wrapper.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{Path(PYTHON).parent}:{os.environ.get('PATH', '')}",
        PYTHONPATH=str(ROOT / "src"),
        LLMSCALE_CACHE_DIR="work/cache",
        F="fixtures",
        TB=TB,
        TBNS=TBNS,
    )
    print(f"{len(cases)} cases; work folder {w}", flush=True)
    if not (w / "fixtures" / "ck").exists():
        build_fixtures(w, env, parse_scripts(text))
    else:  # the fixtures are reused; each case's run folder starts fresh
        shutil.rmtree(w / "runs-test", ignore_errors=True)
        (w / "runs-test").mkdir()
    results = []
    for case in cases:
        t = args.timeout if trains(case.command) else args.cli_timeout
        r = run_case(case, w, env, setups.get(case.id), t)
        results.append(r)
        print(
            f"{r.id:8} {r.cls:13} rc {r.rc!s:4} {r.wall_s:6.1f} s  {r.first_line[:90]}", flush=True
        )
        if args.out:
            args.out.write_text(json.dumps([asdict(x) for x in results], indent=1) + "\n")
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
