"""FedScale's published trace pickles -> this simulator's trace file (``traces import fedscale``).

FedScale (Lai et al., ICML 2022) distributes ``client_device_capacity`` and
``client_behave_trace`` as pickled dicts keyed by integer client id
(benchmark/dataset/data/device_info/README.md in its repository): device entries
``{"computation": ms per sample, "communication": kbit/s}``, behaviour entries
``{"active": [s...], "inactive": [s...], "finish_time": s, "duration": .., "model": ..}`` (the
last two are ignored here, as FedScale's simulator ignores them). How FedScale's simulator
uses them (fedscale/cloud/aggregation/aggregator.py, client_manager.py,
internal/client_metadata.py):

- simulated client k (from 1) gets the device entry whose *key* is ``k mod n_device`` and the
  behaviour entry at *position* ``k mod n_behaviour`` of the dict: two independent modulos, so
  the same device and behaviour rows always meet and a run with more clients than rows repeats
  them;
- a client is online while ``active[i] <= t mod finish_time <= inactive[i]`` for some i;
- a synchronous round takes clients online at its start and keeps the update of those still
  online when it would arrive (start + computation + communication time).

A pickle runs code when loaded, so these are read by an unpickler that builds plain containers
and numbers only: any pickle that names a callable or class (``os.system`` via ``__reduce__``,
a numpy scalar) is refused before anything is called.

The import draws its clients reproducibly instead: ``client-000j`` gets device row ``d[j]``
and behaviour row ``b[j]``, where ``d`` and ``b`` are independent seeded permutations of each
table's rows in key order (numeric), started again when more clients than rows are asked for,
so every row is used as evenly as possible and which device meets which behaviour is random.
The original ids are kept as ``trace_id``.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from foltr_async.errors import FoltrError
from foltr_async.runtime.traces import ClientTrace, load_trace, spread

__all__ = ["import_fedscale", "online_counts", "read_plain_pickle"]


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, numbers, strings, booleans and None; names nothing."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise _Refused(f"{module}.{name}")


class _Refused(Exception):
    pass


def read_plain_pickle(path: str | Path) -> object:
    """Load a pickle that holds only plain data; anything it would call is refused."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FoltrError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise FoltrError(
            f"{path}: refused: the pickle calls {e}; only plain containers and numbers are read"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
        raise FoltrError(f"{path}: not a readable pickle: {e}") from None
    except (MemoryError, RecursionError, OverflowError):
        raise FoltrError(f"{path}: not a readable pickle: too large or too deep") from None


def _rows(table: object, path: Path, what: str) -> list[tuple[object, Mapping]]:
    """A table's (id, entry) rows in key order (numerically for integer ids)."""
    if not isinstance(table, Mapping) or not table:
        got = type(table).__name__
        raise FoltrError(
            f"{path}: expected FedScale's {what}: a dict of client id -> entry, "
            f"got {'an empty dict' if isinstance(table, Mapping) else got}"
        )
    keys = list(table)
    if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        keys.sort()
    elif all(isinstance(k, str) and re.fullmatch(r"-?\d+", k) for k in keys):
        keys.sort(key=int)
    else:
        keys.sort(key=str)
    for k in keys:
        if not isinstance(table[k], Mapping):
            raise FoltrError(f"{path}: client {k}: expected a dict entry, got {table[k]!r:.60}")
    return [(k, table[k]) for k in keys]


def _number(v: object, path: Path, client: object, key: str, *, positive: bool) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > 0 if positive else v >= 0)
    if not ok:
        raise FoltrError(
            f"{path}: client {client}: {key}: expected a number {'> 0' if positive else '>= 0'}"
            f", got {v!r:.60}"
        )
    return float(v)


def _device(path: Path) -> list[dict]:
    out = []
    for k, e in _rows(read_plain_pickle(path), path, "client_device_capacity"):
        out.append(
            {
                "computation": _number(e.get("computation"), path, k, "computation", positive=True),
                "communication": _number(
                    e.get("communication"), path, k, "communication", positive=True
                ),
                "trace_id": k if isinstance(k, int) else str(k),
            }
        )
    return out


def _behaviour(path: Path) -> list[dict]:
    out = []
    for k, e in _rows(read_plain_pickle(path), path, "client_behave_trace"):
        active, inactive = e.get("active"), e.get("inactive")
        if not (isinstance(active, list | tuple) and isinstance(inactive, list | tuple)) or len(
            active
        ) != len(inactive):
            raise FoltrError(
                f"{path}: client {k}: expected active and inactive lists of one length"
            )
        a = [_number(x, path, k, "active", positive=False) for x in active]
        b = [_number(x, path, k, "inactive", positive=False) for x in inactive]
        for x, y in zip(a, b, strict=True):
            if y < x:
                raise FoltrError(f"{path}: client {k}: inactive {y} precedes its active {x}")
        out.append(
            {
                "active": a,
                "inactive": b,
                "finish_time": _number(e.get("finish_time"), path, k, "finish_time", positive=True),
                "trace_id": k if isinstance(k, int) else str(k),
            }
        )
    return out


def online_counts(clients: tuple[ClientTrace, ...], times: np.ndarray) -> np.ndarray:
    """How many of these clients' on/off windows cover each trace time (seconds)."""
    counts = np.zeros(len(times), dtype=np.int64)
    for c in clients:
        if c.intervals is None:
            continue
        s = np.mod(times, c.cycle) if c.cycle else times
        on = np.zeros(len(times), dtype=bool)
        for a, b in c.intervals:
            on |= (s >= a) & (s <= b)
        counts += on
    return counts


def import_fedscale(
    device: str | Path,
    behaviour: str | Path,
    out: str | Path,
    *,
    clients: int | None = None,
    seed: int = 0,
) -> dict:
    """Read both pickles, draw ``clients`` paired rows with ``seed``, write ``out`` (JSON in
    the project's FedScale format); returns facts for the caller to print."""
    device, behaviour, out = Path(device), Path(behaviour), Path(out)
    if out.exists():
        raise FoltrError(f"--out {out}: exists; nothing was replaced. Give a new file name")
    dev, beh = _device(device), _behaviour(behaviour)
    n = min(len(dev), len(beh)) if clients is None else clients
    if n < 1:
        raise FoltrError(f"--clients: expected a whole number >= 1, got {n}")
    rng_dev, rng_beh = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    d, b = spread(len(dev), n, rng_dev), spread(len(beh), n, rng_beh)
    doc = {
        "format": "fedscale",
        "source": {
            "device": device.name,
            "behaviour": behaviour.name,
            "seed": seed,
            "pairing": "independent seeded permutations of each table's rows (numeric key order)",
        },
        "device": {str(j): dev[i] for j, i in enumerate(d.tolist())},
        "behaviour": {str(j): beh[i] for j, i in enumerate(b.tolist())},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    try:
        trace = load_trace(str(tmp))  # the file reads back as any trace would
    except FoltrError:
        tmp.unlink()
        raise
    tmp.replace(out)
    cycle = float(np.median([c.cycle for c in trace.clients]))
    times = np.linspace(0.0, cycle, 2001)[:-1]
    counts = online_counts(trace.clients, times)
    return {
        "clients": n,
        "device_rows": len(dev),
        "device_used": len(set(d.tolist())),
        "behaviour_rows": len(beh),
        "behaviour_used": len(set(b.tolist())),
        "cycle_s": cycle,
        "online_mean": float(counts.mean() / n),
        "nobody_online": float((counts == 0).mean()),
    }
