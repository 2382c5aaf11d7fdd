"""Where parsed data is kept between runs, and its atomic uncompressed ``.npz`` files.

Everything lives under ``$FOLTR_ASYNC_CACHE`` (else ``~/.cache/foltr_async``); an entry that
fails its checks is ignored and built again, and an unwritable folder is skipped.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

__all__ = ["cache_dir", "read_npz", "write_npz"]


def cache_dir() -> Path:
    """Where parsed files are cached: ``$FOLTR_ASYNC_CACHE`` or ``~/.cache/foltr_async``."""
    env = os.environ.get("FOLTR_ASYNC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "foltr_async"


def write_npz(entry: Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomic write of an uncompressed ``.npz`` (temporary file + rename); an unwritable cache
    is silently skipped."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def read_npz(entry: Path, fields: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays of an uncompressed ``.npz`` holding exactly ``fields``, or None when it is
    missing or fails any check.

    Members are read straight into their arrays (``readinto``) with the zip CRC verified by
    ``zlib.crc32``; ``np.load`` would copy through ``zipfile`` at half the speed.
    """
    try:
        out = {}
        with open(entry, "rb") as fh, zipfile.ZipFile(fh) as zf:
            for info in zf.infolist():
                name = info.filename.removesuffix(".npy")
                if name not in fields or info.compress_type != zipfile.ZIP_STORED:
                    return None
                fh.seek(info.header_offset)
                local = fh.read(30)
                if local[:4] != b"PK\x03\x04":
                    return None
                skip = int.from_bytes(local[26:28], "little") + int.from_bytes(
                    local[28:30], "little"
                )
                start = info.header_offset + 30 + skip
                fh.seek(start)
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
                if fortran or dtype.hasobject:
                    return None
                head_len = fh.tell() - start
                fh.seek(start)
                crc = zlib.crc32(fh.read(head_len))
                arr = np.empty(shape, dtype=dtype)
                if arr.nbytes + head_len != info.file_size:
                    return None
                if arr.nbytes and fh.readinto(memoryview(arr.reshape(-1)).cast("B")) != arr.nbytes:
                    return None
                if zlib.crc32(memoryview(arr.reshape(-1)).cast("B"), crc) != info.CRC:
                    return None
                out[name] = arr
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, TypeError):
        return None
    return out if set(out) == set(fields) else None
