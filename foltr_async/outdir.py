"""Output folders: a run writes into a new or empty folder, never over another run's files."""

from __future__ import annotations

from pathlib import Path

from foltr_async.errors import FoltrError

#: files a run writes into its output folder: --out refuses a folder holding any of them
RESULT_FILES = (
    "results.json",
    "summary.md",
    "curves.csv",
    "curves.png",
    "events.jsonl",
    "checkpoint.pkl",
)


def refuse_taken(out: Path, claimed: list[str] = ()) -> None:
    """--out must be a new or empty folder: one line saying what it is or already holds (a
    run's results, or files that are none of ours); nothing in it is touched."""
    if out.exists() and not out.is_dir():
        raise FoltrError(f"--out {out}: not a folder")
    held = [n for n in RESULT_FILES if (out / n).exists()] or list(claimed)
    if held:
        hint = f", or --resume {out} to continue its run" if "checkpoint.pkl" in held else ""
        raise FoltrError(
            f"--out {out}: already holds a run's results ({', '.join(held)}); nothing was "
            f"replaced. Give a new or empty folder{hint}"
        )
    other = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if other:
        shown = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
        raise FoltrError(
            f"--out {out}: not empty and not a run's results folder (holds {shown}); nothing "
            "was written. Give a new or empty folder"
        )


def new_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... if another run (e.g. one started in the same
    second) has it: a folder is created by exactly one run, so results never mix."""
    out, n = base, 1
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                out.mkdir()
                return out
            except FileExistsError:
                n += 1
                out = base.with_name(f"{base.name}-{n}")
    except OSError as e:  # a file where a folder should be, no permission, a full disk
        raise FoltrError(f"cannot create the output folder {out}: {e.strerror}") from None
