"""A run folder belongs to one run: checked, claimed, cleared or resumed before any work.

`open_run_folder` runs before the model is built. Rank 0 decides, and every rank gets its
decision (so all ranks refuse alike):

- paths: the run folder is a folder (or can be made), not a file; the checkpoint folder and
  metrics.jsonl are not in the way; there is free space for the checkpoints the run will keep
  (keep_last + 1 while the newest is written; `plan/checkpoint_size.py` predicts their bytes);
- an earlier run's metrics.jsonl or checkpoints refuse a new run unless it says what to do:
  `--resume` (continue the newest intact checkpoint; none: start from step 0, with a notice, so
  the same command works under automatic restarts; the earlier rows of metrics.jsonl are kept,
  renamed metrics-earlier-N.jsonl) or `--overwrite` (delete llmscale's own
  files of the earlier run first: metrics, checkpoints, prediction, timelines, plots);
- checkpoints it does not own are never written or pruned: checkpoint.folder is inside the run
  folder, or a folder outside that this run created and marked as its own (.llmscale-owner
  names the run folder); another run's checkpoint folder is refused;
- RUN_DIR/.lock (JSON: host, pid, start time) claims the folder; a second live run is refused
  with the holder named, and a lock whose holder is dead (same host, no such pid) is taken
  over with a notice. It is released at the end of the run, also on error.

Refusals are one line, exit 2, and touch nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmscale.config import JobConfig
from llmscale.errors import ConfigError, UsageError
from llmscale.instrument.pipeline import FILE_NAME as PIPELINE_TIMELINE
from llmscale.plan.checkpoint_size import checkpoint_bytes
from llmscale.train.checkpoint import (
    Checkpointer,
    Found,
    newest_intact,
    share_from_rank0,
)
from llmscale.train.launch import restart_attempt
from llmscale.train.prediction import FILE_NAME as PREDICTION
from llmscale.train.progress import SUMMARY
from llmscale.train.weights import check_resume_model
from llmscale.ui import human_bytes

LOCK_NAME = ".lock"
OWNER_NAME = ".llmscale-owner"  # in a checkpoint folder outside its run folder
METRICS = "metrics.jsonl"
# What a run (and `llmscale plot`) writes into its folder; --overwrite removes these only.
OWN_FILES = (
    METRICS,
    PREDICTION,
    PIPELINE_TIMELINE,
    SUMMARY,
    "config.toml",
    "loss.png",
    "timeline.png",
)
OWN_GLOBS = ("timeline-rank*.json", "metrics-earlier-*.jsonl")


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (an existing folder); tests replace this."""
    return shutil.disk_usage(path).free


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# ---- the lock -------------------------------------------------------------------------------


class RunLock:
    """RUN_DIR/.lock: created atomically (a hard link of a complete file), removed by release."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        self.info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token": uuid.uuid4().hex,  # this lock, not just this process (several trainers)
        }
        self.held = False

    def holder(self) -> dict[str, Any] | None:
        """The lock file's content; None when unreadable (damaged: taken over)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
            return None
        return data

    def acquire(self) -> str | None:
        """Take the lock; returns a notice when a stale lock was taken over."""
        notice = None
        tmp = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.info) + "\n")
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return notice
                except FileExistsError:
                    pass
                holder = self.holder()
                host = self.info["host"]
                if holder is None:
                    notice = f"took over {self.path}: it was unreadable"
                elif holder.get("host") == host and (
                    holder["pid"] == os.getpid() or not _pid_alive(holder["pid"])
                ):
                    if holder["pid"] != os.getpid():
                        notice = (
                            f"took over {self.path}: its holder (pid {holder['pid']} on "
                            f"{host}, started {holder.get('started', '?')}) is no longer running"
                        )
                else:
                    raise UsageError(
                        f"run folder {self.path.parent} is in use by another run: pid "
                        f"{holder.get('pid')} on host {holder.get('host')} (started "
                        f"{holder.get('started', '?')}); wait for it to end, or delete "
                        f"{self.path} if that run is gone"
                    )
                self.path.unlink(missing_ok=True)
            raise UsageError(f"could not take {self.path}: other runs keep claiming it")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still ours (not taken over by another run)."""
        if not self.held:
            return
        self.held = False
        holder = self.holder()
        if holder is not None and holder.get("token") == self.info["token"]:
            self.path.unlink(missing_ok=True)


# ---- the decision ---------------------------------------------------------------------------


@dataclass
class RunFolder:
    """What `open_run_folder` decided: where to resume from (None: step 0), the notices
    printed, and (rank 0) the lock, released by `release` (also when this object goes)."""

    path: Path
    resume_from: Path | None = None
    resume_step: int = 0
    notices: list[str] = field(default_factory=list)
    lock: RunLock | None = None
    created: Path | None = None  # rank 0: the folder above the ones this run created

    def release(self) -> None:
        _release(self.lock, self.path, self.created)


def _release(lock: RunLock | None, path: Path, created: Path | None) -> None:
    """The lock released; the folders this run created removed again while they are empty (a
    run refused after the folder was claimed, e.g. by its data, leaves nothing behind)."""
    if lock is not None:
        lock.release()
    if created is not None:
        _remove_empty(path, created)


def earlier_run(run_dir: Path, ckpt_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir` that a new run would clobber ([] if nothing).

    An empty metrics.jsonl is nothing: a run that stopped before its first step (bad data, a
    crash) leaves one, and a rerun must not be refused for it."""
    found = []
    metrics = run_dir / METRICS
    if metrics.exists() and (not metrics.is_file() or metrics.stat().st_size > 0):
        found.append(METRICS)
    if ckpt_dir.is_dir():
        n = sum(1 for p in ckpt_dir.iterdir() if p.name.startswith("step-"))
        if n:
            found.append(f"{n} checkpoint{'s' if n > 1 else ''}")
    return found


def earlier_checkpoint_folder(run_dir: Path) -> Path | None:
    """The checkpoint folder the earlier run's config.toml names, when it is that run's own
    (inside the run folder, or marked with its owner file); None otherwise."""
    import tomllib

    try:
        folder = tomllib.loads((run_dir / "config.toml").read_text())["checkpoint"]["folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(folder, str) or not folder:
        return None
    ckpt = (run_dir / folder).resolve()
    if ckpt.is_relative_to(run_dir.resolve()) or _owner(ckpt) == str(run_dir.resolve()):
        return run_dir / folder
    return None


def own_files(run_dir: Path, ckpt_dir: Path) -> list[Path]:
    """llmscale's own files and folders of a run (what --overwrite deletes): also the
    checkpoints in the folder the earlier run's config.toml names, when another and its own."""
    paths = [run_dir / n for n in OWN_FILES if (run_dir / n).exists()]
    for pattern in OWN_GLOBS:
        paths += sorted(run_dir.glob(pattern))
    folders = [ckpt_dir]
    before = earlier_checkpoint_folder(run_dir)
    if before is not None and before.resolve() != ckpt_dir.resolve():
        folders.append(before)
    for folder in folders:
        if folder.is_dir():
            paths += sorted(p for p in folder.iterdir() if p.name.startswith("step-"))
    return paths


def keep_earlier_metrics(run_dir: Path) -> Path | None:
    """Rename a non-empty metrics.jsonl to the first free metrics-earlier-N.jsonl (a resume
    with no checkpoint starts from step 0; the earlier run's rows are kept, not overwritten)."""
    metrics = run_dir / METRICS
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    n = 1
    while (run_dir / f"metrics-earlier-{n}.jsonl").exists():
        n += 1
    kept = run_dir / f"metrics-earlier-{n}.jsonl"
    os.rename(metrics, kept)
    return kept


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _remove_empty(folder: Path, keep: Path) -> None:
    """Remove `folder` and its parents up to (not including) `keep`, while they are empty."""
    p = folder.absolute()
    while p != keep and p != p.parent:
        try:
            p.rmdir()
        except OSError:
            return
        p = p.parent


def check_paths(cfg: JobConfig) -> None:
    """The run folder, the checkpoint folder and metrics.jsonl can be what they must be."""
    run_dir = Path(cfg.job.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("job.run_dir", str(run_dir), "a folder (this path is a file)")
    base = _existing_ancestor(run_dir)
    if not base.is_dir():
        raise ConfigError("job.run_dir", str(run_dir), f"a folder path ({base} is a file)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            "job.run_dir", str(run_dir), f"a folder you can write ({base} is not writable)"
        )
    ckpt = run_dir / cfg.checkpoint.folder
    if ckpt.exists() and not ckpt.is_dir():
        raise ConfigError(
            "checkpoint.folder", cfg.checkpoint.folder, f"a folder ({ckpt} is a file)"
        )
    if (run_dir / METRICS).is_dir():
        raise ConfigError("job.run_dir", str(run_dir), f"a run folder ({METRICS} is a folder)")


def _owner(ckpt_dir: Path) -> str | None:
    """The run folder named by a checkpoint folder's owner mark (None: unmarked, unreadable)."""
    try:
        data = json.loads((ckpt_dir / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data.get("run_dir") if isinstance(data, dict) else None


def check_owner(cfg: JobConfig) -> bool:
    """A run writes and prunes only checkpoints it owns: those in a folder inside its run
    folder, or in one it created and marked (CKPT/.llmscale-owner names its run folder). True
    when the folder is outside and new (or empty): this run is to mark it. Another run's folder,
    or one of other files, is refused in one line, exit 2."""
    run_dir = Path(cfg.job.run_dir).resolve()
    ckpt = (run_dir / cfg.checkpoint.folder).resolve()
    if ckpt.is_relative_to(run_dir):
        return False
    owner = _owner(ckpt)
    if owner == str(run_dir):
        return False
    try:
        held = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []
    except OSError as e:
        raise ConfigError(
            "checkpoint.folder", cfg.checkpoint.folder, f"a folder this run can read ({e.strerror})"
        ) from None
    if not held:
        return True
    whose = f"files of the run {owner}" if owner else "files this run did not write"
    held = [n for n in held if n != OWNER_NAME] or held
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    raise ConfigError(
        "checkpoint.folder",
        cfg.checkpoint.folder,
        f"a folder inside the run folder, or a new one that this run marks as its own ({ckpt} "
        f"holds {whose}: {shown}; a run writes and prunes only its own checkpoints)",
    )


def claim_checkpoint_folder(cfg: JobConfig) -> None:
    """Create the checkpoint folder outside the run folder and mark it as this run's."""
    run_dir = Path(cfg.job.run_dir).resolve()
    ckpt = run_dir / cfg.checkpoint.folder
    try:
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / OWNER_NAME).write_text(json.dumps({"run_dir": str(run_dir)}) + "\n")
    except OSError as e:
        raise ConfigError(
            "checkpoint.folder", cfg.checkpoint.folder, f"a folder that can be created ({e})"
        ) from None


def saves_in_run(cfg: JobConfig, start: int) -> int:
    """Checkpoints a run from step `start` writes (interval steps, and the last one)."""
    c, steps = cfg.checkpoint, cfg.train.steps
    if not c.enabled or start >= steps:
        return 0
    last = min(steps, c.stop_after) if c.stop_after > start else steps
    at = {last}
    if c.interval:
        at |= {s for s in range(start + 1, last + 1) if s % c.interval == 0}
    return len(at)


def check_space(cfg: JobConfig, ckpt_dir: Path, start: int, kept: int, freed: int) -> int:
    """Refuse when the checkpoints this run writes will not fit; returns the bytes needed.

    `kept` earlier checkpoints stay (a resume), `freed` bytes go first (--overwrite). At most
    keep_last + 1 are on disk at once (the newest is written before the oldest goes).
    """
    n_new = min(saves_in_run(cfg, start), max(1, cfg.checkpoint.keep_last + 1 - kept))
    if n_new == 0:
        return 0
    each = checkpoint_bytes(cfg)
    needed = n_new * each
    where = _existing_ancestor(ckpt_dir)
    free = free_bytes(where) + freed
    if free < needed:
        raise UsageError(
            f"not enough free space for checkpoints in {where}: {n_new} x {human_bytes(each)} "
            f"= {needed} B needed, {free} B free; free some space, lower "
            "checkpoint.keep_last, or choose another job.run_dir"
        )
    return needed


def check_resume(cfg: JobConfig, chosen: Found) -> None:
    """A resume continues its checkpoint: more steps to train, and the model it holds (a
    changed shape would load partly, or not at all); one line each, before anything changes.
    A restarted attempt (--max-restarts) of a job that had written its last checkpoint has
    nothing left to train, and ends as that job would have."""
    finished_job = restart_attempt() > 0 and cfg.train.steps == chosen.step
    if cfg.train.steps <= chosen.step and not finished_job:
        raise ConfigError(
            "train.steps",
            cfg.train.steps,
            f"more than {chosen.step}, the step of checkpoint {chosen.path} that --resume "
            "continues (it is trained that far already)",
        )
    check_resume_model(chosen.path, cfg.model)


def _decide(cfg: JobConfig, say: Any) -> RunFolder:
    """Rank 0's checks and decision; the lock is held when it returns."""
    run_dir = Path(cfg.job.run_dir)
    resume, overwrite = cfg.checkpoint.resume, cfg.job.overwrite
    if resume and overwrite:
        raise UsageError("--resume and --overwrite exclude each other: choose one")
    check_paths(cfg)
    claim = check_owner(cfg)
    ckpt_dir = run_dir / cfg.checkpoint.folder
    earlier = earlier_run(run_dir, ckpt_dir)
    if earlier and not (resume or overwrite):
        raise UsageError(
            f"run folder {run_dir} holds an earlier run ({', '.join(earlier)}): continue it "
            "with --resume, start again with --overwrite (deletes it), or choose another "
            "--job.run_dir"
        )
    created = _existing_ancestor(run_dir)  # what to remove again if refused below
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            "job.run_dir", str(run_dir), f"a folder that can be created ({e.strerror})"
        ) from None
    out = RunFolder(run_dir, lock=RunLock(run_dir), created=created)
    assert out.lock is not None
    try:
        try:
            notice = out.lock.acquire()
        except PermissionError as e:
            raise ConfigError(
                "job.run_dir", str(run_dir), f"a folder you can write ({e.strerror})"
            ) from None
        if notice:
            say(out, notice)
        if claim:
            claim_checkpoint_folder(cfg)
            say(
                out,
                f"checkpoint.folder {ckpt_dir.resolve()} is outside the run folder: marked as "
                f"this run's ({OWNER_NAME}); only this run writes and prunes there",
            )
        checkpointer = Checkpointer(ckpt_dir, cfg.checkpoint.keep_last)
        kept, freed, chosen = 0, 0, None
        doomed: list[Path] = []
        before: Path | None = None
        if resume:
            chosen = newest_intact(
                ckpt_dir,
                lambda text: say(out, text),
                purpose=" to resume from",
                advice="; --overwrite starts again",
            )
            if chosen is not None:
                check_resume(cfg, chosen)
            kept = min(len(checkpointer.checkpoints()), cfg.checkpoint.keep_last)
        elif overwrite:
            doomed = own_files(run_dir, ckpt_dir)
            before = earlier_checkpoint_folder(run_dir)
            freed = sum(_size(p) for p in doomed)
        start = chosen.step if chosen is not None else 0
        check_space(cfg, ckpt_dir, start, kept, freed)
        if overwrite:
            for p in doomed:
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            if before is not None and before.resolve() != ckpt_dir.resolve():
                _remove_empty(before, run_dir.absolute())
            if doomed:
                say(out, f"--overwrite: removed the earlier run's files from {run_dir}")
        if resume and chosen is None:
            kept_rows = keep_earlier_metrics(run_dir)
            also = f"; the earlier {METRICS} kept as {kept_rows.name}" if kept_rows else ""
            say(out, f"--resume: no checkpoint in {ckpt_dir}: starting from step 0{also}")
        if chosen is not None:
            out.resume_from, out.resume_step = chosen.path, chosen.step
    except BaseException:
        out.release()
        raise
    return out


def open_run_folder(cfg: JobConfig, rank: int = 0) -> RunFolder:
    """Check, claim and prepare the run folder (rank 0); every rank returns or raises alike.

    Call it after the process group is up (the decision is broadcast) and before any work.
    """
    from llmscale.ui import console

    printer = console(stderr=True)

    def say(folder: RunFolder, text: str) -> None:
        folder.notices.append(text)
        printer.print(f"[yellow]{text}[/]", highlight=False)

    decided: RunFolder | None = None
    failure: ConfigError | UsageError | None = None
    if rank == 0:
        try:
            decided = _decide(cfg, say)
        except (ConfigError, UsageError) as e:
            failure = e
    mine = (
        (str(failure), None, 0)
        if decided is None
        else (None, str(decided.resume_from) if decided.resume_from else None, decided.resume_step)
    )
    error, path, step = share_from_rank0(mine)
    if error is not None:
        if failure is not None:
            raise failure
        raise UsageError(error)
    if decided is None:  # another rank: rank 0's decision
        return RunFolder(Path(cfg.job.run_dir), Path(path) if path else None, step)
    if decided.lock is not None:
        # Released at the end of the run; this is the backstop (an error before the loop).
        weakref.finalize(decided, _release, decided.lock, decided.path, decided.created)
    return decided
