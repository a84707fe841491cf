"""Where a command will write, checked before the work: one-line errors instead of a traceback
after it (a PNG, a JSON or Markdown file, a run folder). Torch-free.

Each check creates nothing that stays: it writes (and removes) a probe where the output will go,
since only a real write tells a read-only mount, /proc or a missing permission apart.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from llmscale.errors import ConfigError

# The checkout this package runs from (src/llmscale/paths.py -> the repository root) and what
# `make results` measured there: found from the package, never from the working directory. An
# installed copy has neither (the claims then say what was not measured).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
RESULTS_JSON = SOURCE_ROOT / "docs" / "results" / "results.json"


def cache_dir() -> Path:
    """The per-user cache of measurements and checks: `$LLMSCALE_CACHE_DIR`, else
    `$XDG_CACHE_HOME/llmscale`, else `~/.cache/llmscale` (nothing in it is needed: a missing or
    unwritable cache only costs the work again)."""
    explicit = os.environ.get("LLMSCALE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmscale"


_NOTICED: set[str] = set()  # the cache notices this process has printed


def cache_notice(text: str) -> None:
    """`notice: TEXT` on stderr, once per process for a text: a cache that cannot be used never
    fails a command (it only costs the work again), but a command that pays for the work on
    every run says why. Rank 0's only, under torchrun (its ranks share the cache)."""
    if text in _NOTICED or os.environ.get("RANK", "0") != "0":
        return
    _NOTICED.add(text)
    print(f"notice: {text}", file=sys.stderr, flush=True)


def os_reason(e: OSError) -> str:
    """An OSError in a few words: `PermissionError: Permission denied`."""
    return f"{type(e).__name__}: {e.strerror or e}"


def cache_write_problem(folder: Path, e: OSError) -> str:
    """Why a file could not be written in the cache `folder`, after `e`: the folder (or a folder
    above it) is a file, else it is not writable."""
    nearest = _nearest_existing(folder)
    if not nearest.is_dir():
        return f"{nearest} is a file, not a folder"
    return f"{folder} is not writable ({os_reason(e)})"


def _nearest_existing(path: Path) -> Path:
    """`path` or the closest ancestor of it that exists (what creating `path` would write in)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be created in the existing `folder`, or None when one can."""
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".llmscale-probe-", dir=folder)
    except OSError as e:
        return f"cannot write in {folder}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def folder_problem(path: str | Path) -> str | None:
    """Why `path` cannot be used as (or created as) a writable folder; None when it can."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} is a file"
    return _cannot_write_in(_nearest_existing(p))


def file_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at `path` (its missing folders created); None when it can."""
    p = Path(path)
    if p.is_dir():
        return f"{p} is a folder"
    if p.exists():
        return None if os.access(p, os.W_OK) else f"{p} is not writable"
    return _cannot_write_in(_nearest_existing(p.parent))


def check_output_file(flag: str, path: str | Path) -> Path:
    """`path` as a Path, or a ConfigError naming `flag` when no file can be written there."""
    problem = file_problem(path)
    if problem:
        raise ConfigError(flag, str(path), f"a file path that can be written ({problem})")
    return Path(path)


def check_output_folder(flag: str, path: str | Path) -> Path:
    """`path` as a Path, or a ConfigError naming `flag` when it cannot be a writable folder."""
    problem = folder_problem(path)
    if problem:
        raise ConfigError(flag, str(path), f"a folder that can be created and written ({problem})")
    return Path(path)


# What matplotlib's Agg canvas writes (canvas.get_supported_filetypes()); another suffix is a
# ValueError from savefig after the drawing is done.
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff",
                  ".webp", ".gif", ".avif", ".pgf", ".raw", ".rgba")  # fmt: skip


def check_image_file(flag: str, path: str | Path) -> Path:
    """Where a chart goes: `path`, with `.png` added when it has no suffix (matplotlib would add
    it anyway, and the message must name the file written); an unknown suffix is an error."""
    p = Path(path)
    if not p.suffix and not p.is_dir():
        p = p.with_name(p.name + ".png")
    elif p.suffix.lower() not in IMAGE_SUFFIXES and not p.is_dir():
        raise ConfigError(flag, str(path), "an image file: " + " | ".join(IMAGE_SUFFIXES))
    return check_output_file(flag, p)
