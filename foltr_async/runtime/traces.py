"""Device traces: per-client compute speed, bandwidth and availability read from trace files.

Two published families, read from JSON or CSV equivalents (pickles are never loaded here: a
pickle runs code when read; ``foltr_async.runtime.trace_import`` converts FedScale's published
pickles with a data-only unpickler). Trace clients are taken in key order (numerically when
every key is an integer) and simulated client ``client-000i`` gets the entry ``i mod n``.

FedScale (Lai et al., ICML 2022) publishes ``client_device_capacity`` (client ->
``{"computation": ms per sample, "communication": kbit/s}``) and ``client_behave_trace``
(client -> ``{"active": [t...], "inactive": [t...], "finish_time": T, ...}``, seconds; the
client is online while ``active[k] <= t mod T <= inactive[k]`` for some k, as FedScale's
``ClientMetadata.is_active``). Here: a JSON object ``{"format": "fedscale", "device": {...},
"behaviour": {...}}`` with those two tables (either may be left out), or a CSV of the device
table with the header ``client_id,computation,communication``. Pairing of the two tables: by
client id when both name the same clients (as ``traces import fedscale`` writes them); else the
longer table's rows in order, each with a row of the shorter drawn by one seeded mapping
(``spread``, seed 0: every shorter row used as evenly as possible, in random order), not
``i mod n_device`` with ``i mod n_behaviour``, which always pairs the same rows.

FLGo (Wang et al. 2023) describes each client by state variables its simulator steps once per
time unit: ``prob_available`` (offline -> online), ``prob_unavailable`` (online -> offline) and
``latency`` (time units from the model's broadcast to the update's arrival). Here: JSON
``{"format": "flgo", "clients": {id: {"prob_available": .., "prob_unavailable": ..,
"latency": ..}}}``; the availability chain steps once per round (asynchronous runs: per period)
and starts from its stationary distribution.

Mapping to the simulator: a client's compute-time factor is its ``computation`` (FedScale) or
``latency`` (FLGo) over the trace's median, so the median device trains in the protocol's
``compute_time`` per interaction; its bandwidth is ``communication * 1000 / 8`` bytes/s (a link
between two agents runs at the slower end's bandwidth; the server's is ``network.bandwidth``).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from foltr_async.errors import ScenarioError
from foltr_async.inputs import MB, read_capped
from foltr_async.runtime import heap

__all__ = ["ClientTrace", "Trace", "load_trace"]

_INDEX = re.compile(r"^client-(\d+)$")
#: the largest trace file read (it is read whole, then parsed)
MAX_TRACE_BYTES = 256 * MB


@dataclass(frozen=True)
class ClientTrace:
    """One trace client, in the simulator's units (None: the trace does not say)."""

    compute_factor: float | None = None
    bandwidth: float | None = None  # bytes per second
    intervals: tuple[tuple[float, float], ...] | None = None  # online windows within a cycle
    cycle: float | None = None  # seconds after which the windows repeat
    p_on: float | None = None  # Markov availability: offline -> online per step
    p_off: float | None = None  # online -> offline per step

    def online_at(self, t: float) -> bool:
        """FedScale behaviour: whether ``t`` (seconds) falls in an online window."""
        s = t % self.cycle if self.cycle else t
        return any(a <= s <= b for a, b in self.intervals)


@dataclass(frozen=True)
class Trace:
    """A loaded trace: its family and its clients in order."""

    path: str
    format: str
    clients: tuple[ClientTrace, ...]

    def of(self, agent_id: str) -> ClientTrace | None:
        """The trace entry of a simulated client (None for the server and other agents)."""
        m = _INDEX.match(agent_id)
        if m is None or not self.clients:
            return None
        return self.clients[int(m.group(1)) % len(self.clients)]

    @property
    def has_windows(self) -> bool:
        """FedScale on/off windows (time-driven availability)."""
        return any(c.intervals is not None for c in self.clients)

    @property
    def has_availability(self) -> bool:
        return any(c.intervals is not None or c.p_on is not None for c in self.clients)


def _fail(path: str, what: str) -> ScenarioError:
    return ScenarioError(f"network.trace: {path}: {what}")


def _ordered(table: Mapping, path: str, what: str) -> list:
    if not isinstance(table, Mapping) or not table:
        raise _fail(path, f"expected {what} as a non-empty object of client -> entry")
    keys = list(table)
    if all(re.fullmatch(r"-?\d+", str(k)) for k in keys):
        keys.sort(key=lambda k: int(k))
    else:
        keys.sort(key=str)
    return [(str(k), table[k]) for k in keys]


def _num(entry: Mapping, key: str, path: str, client: str, *, lo: float = 0.0, hi=None) -> float:
    v = entry.get(key) if isinstance(entry, Mapping) else None
    x, got = math.nan, repr(v)
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            x = float(v)
        except OverflowError:  # JSON integers have no size limit: 10**400
            got = "an integer beyond the float range"
    if not (math.isfinite(x) and x >= lo and (hi is None or x <= hi)):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _fail(path, f"client {client}: {key}: expected a number {rng}, got {got}")
    return x


def _relative(values: list[float]) -> list[float]:
    """Each value over the median (the median device gets factor 1)."""
    med = float(np.median(values))
    if med <= 0.0:
        return [1.0] * len(values)
    return [v / med for v in values]


def _fedscale(doc: Mapping, path: str) -> tuple[ClientTrace, ...]:
    device = doc.get("device")
    behaviour = doc.get("behaviour")
    if device is None and behaviour is None:
        raise _fail(path, 'expected a "device" and/or a "behaviour" table')
    factors: list[float] = []
    bandwidths: list[float] = []
    dev_ids: list[str] = []
    if device is not None:
        rows = _ordered(device, path, '"device"')
        comp = [_num(e, "computation", path, c, lo=1e-12) for c, e in rows]
        bandwidths = [_num(e, "communication", path, c, lo=1e-12) * 1000.0 / 8.0 for c, e in rows]
        factors = _relative(comp)
        dev_ids = [c for c, _ in rows]
    windows: list[tuple[tuple[tuple[float, float], ...], float]] = []
    beh_ids: list[str] = []
    if behaviour is not None:
        for c, e in _ordered(behaviour, path, '"behaviour"'):
            beh_ids.append(c)
            active, inactive = (
                e.get(k) if isinstance(e, Mapping) else None for k in ("active", "inactive")
            )
            if not (isinstance(active, list) and isinstance(inactive, list)) or len(active) != len(
                inactive
            ):
                raise _fail(path, f"client {c}: expected active and inactive lists of one length")
            pairs = []
            for a, b in zip(active, inactive, strict=True):
                a = _num({"active": a}, "active", path, c)
                b = _num({"inactive": b}, "inactive", path, c)
                if b < a:
                    raise _fail(path, f"client {c}: an inactive time {b} precedes its active {a}")
                pairs.append((a, b))
            cycle = _num(e, "finish_time", path, c, lo=1e-9)
            windows.append((tuple(pairs), cycle))
    dev_rows, beh_rows = _pairing(dev_ids, beh_ids)
    out = []
    for i in range(max(len(dev_rows), len(beh_rows))):
        kw: dict = {}
        if factors:
            kw["compute_factor"] = factors[dev_rows[i]]
            kw["bandwidth"] = bandwidths[dev_rows[i]]
        if windows:
            kw["intervals"], kw["cycle"] = windows[beh_rows[i]]
        out.append(ClientTrace(**kw))
    return tuple(out)


def spread(n_rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` row numbers out of ``n_rows``: seeded permutations laid end to end (so each row is
    used ``n // n_rows`` or one more times, in random order)."""
    reps = -(-n // n_rows)
    return np.concatenate([rng.permutation(n_rows) for _ in range(reps)])[:n]


def _pairing(dev_ids: list[str], beh_ids: list[str]) -> tuple[list[int], list[int]]:
    """Row numbers of each trace client's device and behaviour entry: by id when the tables
    name the same clients (or only one table is given), else the longer table in order and the
    shorter spread over it by one seeded mapping (seed 0)."""
    if not dev_ids or not beh_ids or dev_ids == beh_ids:  # one key order for one key set
        return list(range(len(dev_ids))), list(range(len(beh_ids)))
    n = max(len(dev_ids), len(beh_ids))
    rng = np.random.default_rng(0)
    if len(dev_ids) >= len(beh_ids):
        return list(range(n)), spread(len(beh_ids), n, rng).tolist()
    return spread(len(dev_ids), n, rng).tolist(), list(range(n))


def _flgo(doc: Mapping, path: str) -> tuple[ClientTrace, ...]:
    rows = _ordered(doc.get("clients"), path, '"clients"')
    latencies = [
        _num(e, "latency", path, c) if isinstance(e, Mapping) and "latency" in e else None
        for c, e in rows
    ]
    known = [x for x in latencies if x is not None]
    rel = iter(_relative(known)) if known else iter(())
    out = []
    for (c, e), lat in zip(rows, latencies, strict=True):
        p_on = _num(e, "prob_available", path, c, hi=1.0)
        p_off = _num(e, "prob_unavailable", path, c, hi=1.0)
        if p_on + p_off == 0.0:
            raise _fail(path, f"client {c}: prob_available and prob_unavailable are both 0")
        out.append(
            ClientTrace(compute_factor=None if lat is None else next(rel), p_on=p_on, p_off=p_off)
        )
    return tuple(out)


def _csv_device(text: str, path: str) -> dict:
    header, *rows = list(csv.reader(text.splitlines())) or [[]]
    need = ("client_id", "computation", "communication")
    if not rows or not set(need) <= set(header):
        raise _fail(path, "expected a CSV header client_id,computation,communication")
    col = {name: header.index(name) for name in need}
    device = {}
    for line, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise _fail(
                path,
                f"line {line}: expected {len(header)} fields ({','.join(header)}), got {len(row)}",
            )
        client = row[col["client_id"]]
        try:
            device[client] = {k: float(row[col[k]]) for k in ("computation", "communication")}
        except ValueError:
            raise _fail(path, f"client {client}: expected numbers") from None
    return {"format": "fedscale", "device": device}


@heap.process_cache(maxsize=16)
def _load(path: str, mtime: float) -> Trace:
    p = Path(path)
    text = read_capped(p, MAX_TRACE_BYTES, "trace file").decode("utf-8")
    if p.suffix.lower() == ".csv":
        doc = _csv_device(text, path)
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise _fail(path, f"invalid JSON: {e.msg} (line {e.lineno})") from None
        except ValueError as e:  # an integer of more digits than Python converts
            raise _fail(path, f"invalid JSON: {str(e).split(';')[0]}") from None
        except RecursionError:
            raise _fail(path, "invalid JSON: nested too deeply") from None
    if not isinstance(doc, Mapping) or doc.get("format") not in ("fedscale", "flgo"):
        raise _fail(path, 'expected a JSON object with "format": "fedscale" or "flgo"')
    clients = _fedscale(doc, path) if doc["format"] == "fedscale" else _flgo(doc, path)
    return Trace(path, doc["format"], clients)


def _is_pickle(p: Path) -> bool:
    """A pickle's first bytes: PROTO (protocol 2 and later), or a protocol 0/1 dict."""
    try:
        with p.open("rb") as fh:
            head = fh.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head in (b"(d", b"}q", b"}r")


def load_trace(path: str) -> Trace:
    """Read and check a trace file (cached while the file is unchanged); one-line errors."""
    p = Path(path)
    try:
        mtime = p.stat().st_mtime
    except OSError:
        raise _fail(
            path, "no such file (relative paths: from the current folder or the scenario's)"
        ) from None
    if p.is_file() and _is_pickle(p):  # never open a FIFO or device: read_capped refuses it
        raise _fail(
            path,
            "a pickle (FedScale publishes its traces so) is never loaded as a trace; convert it "
            "with: python -m foltr_async traces import fedscale DEVICE BEHAVIOUR --out FILE.json",
        )
    try:
        return _load(str(p), mtime)
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot read: {e}") from None
    except ValueError as e:  # read_capped: not a regular file, or too large
        raise _fail(path, str(e)) from None
