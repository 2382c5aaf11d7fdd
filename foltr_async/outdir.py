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
    if out.is_symlink() and not out.exists():
        raise FoltrError(
            f"--out {out}: a symbolic link to {out.readlink()}, which does not exist; create "
            "that folder or give another one"
        )
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


#: the file a run holds locked in its output folder while it runs
LOCK_FILE = ".lock"
_held_locks: list = []  # open lock files: the lock lasts until this process exits


def lock(out: Path, flag: str) -> None:
    """Hold ``out``'s lock (``flock``) for the rest of this process: two runs in one folder
    (two ``--resume`` of it, say) would interleave their checkpoints and results, so the
    second stops here in one line. The kernel releases it when the process ends, however."""
    import fcntl

    try:
        fh = open(out / LOCK_FILE, "a")  # noqa: SIM115 - held open until the process exits
    except OSError as e:
        raise FoltrError(f"{flag} {out}: cannot write in the folder: {e.strerror}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise FoltrError(
            f"{flag} {out}: in use by another run (it holds {out / LOCK_FILE}); wait for it to "
            "end or stop it, then try again"
        ) from None
    _held_locks.append(fh)


def release_locks() -> None:
    """Let go of every output folder this process locked (a command is done with them)."""
    while _held_locks:
        _held_locks.pop().close()
