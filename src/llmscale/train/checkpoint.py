"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP), written atomically and
verified before use.

Every command that reads a checkpoint goes through one reader here, `choose_checkpoint` (train
--resume through `newest_intact`, export, generate, eval, checkpoint.init_from RUN_DIR, ckpt):
it verifies each candidate against its manifest, falls back from a damaged newest checkpoint to
the newest intact one with a one-line notice on stderr, and raises one line (exit 2) when none
is intact or the step asked for is damaged. `Checkpointer.load` turns a DCP failure on a
verified checkpoint into one line too.

Layout: RUN_DIR/checkpoints/step-000010/ (DCP files, .metadata and manifest.json). Every rank
writes into step-000010.tmp/; once all have finished, rank 0 writes manifest.json (the size and
sha256 of every file, the step, the parallel layout it was saved under, the llmscale version,
and what the caller adds: the trainer records the model's shape and the precision mode),
fsyncs the files and the folder, renames it to step-000010 and fsyncs the parent. A folder
without the suffix is therefore complete, and its manifest says what complete means: loading
verifies it, so a checkpoint with flipped bytes, a truncated or missing file, a file the
manifest does not list (or a manifest listing none), or no manifest is skipped (with a warning
naming it) for the newest intact one. An interrupted save leaves only a .tmp folder, which is
ignored and removed by the next save; a failed save (full disk, permissions) removes its .tmp,
keeps the earlier checkpoints and stops the run with one line naming the last good step.
A checkpoint is deleted (pruned, or replaced by a re-save of its step) by renaming it to a
trash name first (step-000010.pruned.tmp, .replaced.tmp), so a kill while its files go leaves
no half-deleted step-N folder: the trash is ignored by every reader and `ckpt list`, and
removed by the next save.

Only the newest `keep_last` checkpoints are kept, and never at the cost of the one just written:
checkpoints with a higher step than the current one (an abandoned history, e.g. damaged ones
skipped at resume) count as the oldest. DCP stores each rank's shards with their global layout,
so a checkpoint saved under one parallel layout loads under another. The folder must be on a
file system every rank sees.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from llmscale.errors import ConfigError, ExitCode, JobStopped, UsageError

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20
TRASH_SUFFIXES = (".pruned.tmp", ".replaced.tmp")  # a checkpoint being deleted


def is_trash(path: Path) -> bool:
    """A checkpoint folder renamed to be deleted (see the module docstring)."""
    return path.name.endswith(TRASH_SUFFIXES)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def share_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- manifest -------------------------------------------------------------------------------


def _hash_file(path: Path, sync: bool = False) -> tuple[int, str]:
    """(size, sha256) of a file; with `sync`, its data is flushed to disk too."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _version() -> str:
    """The installed llmscale's version (the package root is above this layer)."""
    try:
        return importlib.metadata.version("llmscale")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(
    folder: Path,
    step: int,
    layout: dict[str, int] | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Hash (and fsync) every file of a written checkpoint folder, then write manifest.json
    (with `extra`'s entries, e.g. the model's shape, beside the fixed ones)."""
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            size, digest = _hash_file(p, sync=True)
            files[p.name] = {"size": size, "sha256": digest}
    manifest = {
        **(extra or {}),
        "format": 1,
        "step": step,
        "layout": layout or {},
        "llmscale_version": _version(),
        "files": files,
    }
    with (folder / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder; OSError or ValueError when missing or unreadable."""
    data = json.loads((folder / MANIFEST).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError("not a manifest")
    return data


def verify_checkpoint(folder: Path) -> str | None:
    """None when the manifest lists every file of the folder and each is there with its size
    and checksum; else why not, in a few words (e.g. 'no manifest.json', '__0_0.distcp
    truncated: 1000 of 3624265 B', 'manifest.json lists no files')."""
    if not (folder / MANIFEST).is_file():
        return f"no {MANIFEST}"
    try:
        manifest = read_manifest(folder)
        listed = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if not listed:
        return f"{MANIFEST} lists no files"
    for name, (want, sha256) in sorted(listed.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        have = path.stat().st_size
        if have != want:
            what = "truncated" if have < want else "too long"
            return f"{name} {what}: {have} of {want} B"
        try:
            _, digest = _hash_file(path)
        except OSError as e:
            return f"{name} unreadable ({e.strerror or type(e).__name__})"
        if digest != sha256:
            return f"{name} corrupt: checksum mismatch"
    # A manifest lists every file of its step: one that leaves a file out does not describe
    # this folder (rewritten, or files added after the save).
    unlisted = sorted(
        p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in listed
    )
    if unlisted:
        return f"{unlisted[0]} not listed in {MANIFEST}"
    return None


# ---- finding checkpoints --------------------------------------------------------------------


class Found(NamedTuple):
    step: int
    path: Path


@dataclass
class Damaged:
    step: int
    path: Path
    problem: str

    def describe(self) -> str:
        return f"{self.path.name} ({self.problem})"


@dataclass
class Selection:
    """The newest intact checkpoint (None if none) and the damaged ones newer than it."""

    chosen: Found | None
    damaged: list[Damaged] = field(default_factory=list)


class Checkpointer:
    """Saves, finds and verifies checkpoints under one folder.

    `layout` (the parallel degrees and world size) and `extra` are recorded in each manifest.
    """

    def __init__(
        self,
        folder: str | Path,
        keep_last: int = 2,
        layout: dict[str, int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.layout = layout
        self.extra = extra

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:06d}"

    def checkpoints(self) -> list[Found]:
        """Finished (renamed) checkpoint folders, oldest first, intact or not."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append(Found(int(m.group(1)), p))
        return sorted(found)

    def select(self) -> Selection:
        """Verify from the newest down; stop at the first intact one."""
        damaged: list[Damaged] = []
        for found in reversed(self.checkpoints()):
            problem = verify_checkpoint(found.path)
            if problem is None:
                return Selection(found, damaged)
            damaged.append(Damaged(found.step, found.path, problem))
        return Selection(None, damaged)

    def latest(self) -> Found | None:
        """The newest intact checkpoint."""
        return self.select().chosen

    # ---- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (tensors, DTensors, Stateful objects, plain values) for `step`.

        A failed write stops the run (JobStopped, exit 1) with the last good step named; the
        earlier checkpoints are left as they were.
        """
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        problem = None
        if _rank() == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                for stale in self.folder.glob("*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError as e:
                problem = _describe_failure(e)
        problem = share_from_rank0(problem)
        if problem is None:
            _barrier()
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.save(state, checkpoint_id=str(tmp))
            except (OSError, RuntimeError, CheckpointException) as e:
                problem = _describe_failure(e)
                if problem is None:
                    raise
            # DCP gathers every rank's write result: all ranks see the same failure.
        if problem is None and _rank() == 0:
            try:
                self._finish(step, tmp, final)
            except OSError as e:
                problem = _describe_failure(e)
        problem = share_from_rank0(problem)
        if problem is not None:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _barrier()
            raise JobStopped(self._failure_message(step, problem), ExitCode.FAILURE)
        _barrier()
        return final

    def _finish(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0, after every rank wrote: manifest, fsync, rename, prune."""
        write_manifest(tmp, step, self.layout, self.extra)
        old = None
        if final.exists():  # re-saving a step (after a resume): swap, then drop the old one
            old = final.with_name(final.name + ".replaced.tmp")
            final.rename(old)
        tmp.rename(final)
        fsync_dir(self.folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.prune(step)

    def prune(self, current: int) -> list[Path]:
        """Delete all but the newest keep_last, always keeping `current`'s; checkpoints past
        `current` (another history) count as the oldest. Returns the deleted folders."""
        others = [f for f in self.checkpoints() if f.step != current]
        others.sort(key=lambda f: (f.step <= current, f.step))
        doomed = others[: max(0, len(others) - (self.keep_last - 1))]
        trashed = []
        for f in doomed:
            trash = f.path.with_name(f.path.name + ".pruned.tmp")
            shutil.rmtree(trash, ignore_errors=True)
            try:
                f.path.rename(trash)  # atomic: a kill later leaves trash, never a half step
            except OSError:
                continue  # kept (as rmtree's ignore_errors did): the next save tries again
            trashed.append((f.path, trash))
        if trashed:
            fsync_dir(self.folder)
        for _, trash in trashed:
            shutil.rmtree(trash, ignore_errors=True)
        return [path for path, _ in trashed]

    def _failure_message(self, step: int, problem: str) -> str:
        last = self.latest()
        kept = (
            f"the last good checkpoint is step {last.step} ({last.path})"
            if last is not None
            else "there is no earlier checkpoint"
        )
        return f"checkpoint of step {step} failed: {problem}; its .tmp was removed; {kept}"

    def load(self, path: str | Path, state: dict[str, Any]) -> None:
        """Fill `state` in place from a checkpoint (resharding to the current layout).

        A checkpoint that passed its manifest check but that DCP cannot read (written by
        another torch, or holding other keys or shapes than `state` asks for) is one line.
        """
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(path))
        except torch.OutOfMemoryError:
            raise
        except (CheckpointException, RuntimeError, ValueError, AssertionError, KeyError) as e:
            raise UsageError(
                f"checkpoint {path} could not be read: {_first_line(e)} (`llmscale ckpt verify` "
                "checks it against its manifest)"
            ) from None


def _first_line(exc: BaseException) -> str:
    """The first line of an exception (a DCP rank's own failure when it wraps one)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))
        exc = failure[0] if isinstance(failure, tuple) else failure
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


# ---- the reader -------------------------------------------------------------------------------


def notice(text: str) -> None:
    """A one-line notice on stderr, from rank 0 only (every rank reads the same folder)."""
    if _rank() != 0 or os.environ.get("RANK", "0") != "0":
        return
    from rich.markup import escape

    from llmscale.ui import console

    console(stderr=True).print(f"[yellow]{escape(text)}[/]")


def newest_intact(
    folder: Path, say: Callable[[str], None] = notice, purpose: str = "", advice: str = ""
) -> Found | None:
    """The newest intact checkpoint under `folder` (None: there is none at all).

    Each damaged one newer than it is named by `say`; when every checkpoint is damaged, a
    UsageError naming them (`purpose`, e.g. " to resume from", ends its first clause; `advice`
    is added to the closing parenthesis).
    """
    sel = Checkpointer(folder).select()
    if sel.chosen is None and sel.damaged:
        raise UsageError(
            f"no intact checkpoint in {folder}{purpose}: "
            + "; ".join(d.describe() for d in sel.damaged)
            + f" (`llmscale ckpt verify` lists them{advice})"
        )
    for d in sel.damaged:
        assert sel.chosen is not None
        say(f"skipping damaged checkpoint {d.path} ({d.problem}): using {sel.chosen.path.name}")
    return sel.chosen


def choose_checkpoint(
    folder: Path,
    *,
    source: str,
    field: str = "RUN_DIR",
    step: int | None = None,
    say: Callable[[str], None] = notice,
) -> Found:
    """The checkpoint a command reads from `folder` (of the run `source`, named by `field` in
    errors): the one of `step` when given (it must be intact), else the newest intact one."""
    found = Checkpointer(folder).checkpoints()
    if not found:
        raise ConfigError(field, source, "a run with a checkpoint (none found)")
    if step is None:
        chosen = newest_intact(folder, say)
        assert chosen is not None
        return chosen
    for f in found:
        if f.step == step:
            problem = verify_checkpoint(f.path)
            if problem is not None:
                raise ConfigError(
                    "--step",
                    step,
                    f"an intact checkpoint ({f.path} is damaged: {problem}; `llmscale ckpt "
                    "verify` lists the intact ones)",
                )
            return f
    raise ConfigError("--step", step, " | ".join(str(f.step) for f in found))


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind an exception: itself, its cause/context, or a DCP rank's failure."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _describe_failure(exc: BaseException) -> str | None:
    """A few words for a failed write (None when it is not a write failure: a bug)."""
    os_error = _os_error_in(exc)
    if os_error is not None:
        if os_error.errno == errno.ENOSPC:
            return "no space left on device"
        reason = os_error.strerror or str(os_error)
        where = f" ({os_error.filename})" if os_error.filename else ""
        return f"{reason}{where}"
    text = str(exc)
    # torch's file writer reports a short write (a full disk) without the OSError.
    if any(s in text for s in ("PytorchStreamWriter", "inline_container", "unexpected pos")):
        return "write failed (" + text.splitlines()[0][:120] + "); is the disk full?"
    return None
