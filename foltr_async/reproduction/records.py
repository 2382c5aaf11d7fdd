"""Results of record: the compact summary of a finished reproduction run that claims are
computed from, committed under ``reproduce/claims/records/``.

A record keeps, per variant and repeat (fold, seed), the evaluated rounds with their offline
metrics, the online metric through each evaluation and the interactions: everything a claim
reads, a few hundred kB for the largest run. It also keeps what made it: the scenario file and
overrides, the reference variant's settings, the code stamp and a hash of every source file
that can change a result. A record whose files differ from the checkout's is *stale*: the code
that made it is not the code that would make it now.

Re-making a record costs its whole run. A *check* re-runs one repeat of every variant (the
first fold and seed) with the checkout's code and compares it with the record, field by field:
when every one is equal, the record keeps its numbers and gains ``checked`` (that code's file
hashes, stamp, date and what was re-run), and is stale again only when a file changes after
that. A check that finds a difference changes nothing: the run must be recorded again.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from foltr_async.errors import FoltrError
from foltr_async.provenance import check_same_code, source_hashes

#: significant digits a record keeps of each metric (the report shows four decimals; a curve of
#: a long unlearning run is thousands of evaluations, so a full double would be megabytes)
DIGITS = 7


def _g(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.{DIGITS}g}")


def _repeat(rep: dict) -> dict:
    interactions = rep.get("interactions") or []
    return {
        "fold": rep.get("fold"),
        "seed": rep["seed"],
        "rounds": rep.get("rounds", []),
        "offline": {m: [_g(v) for v in vals] for m, vals in (rep.get("offline") or {}).items()},
        "online_at": [_g(v) for v in rep.get("online_at", [])],
        "online": _g((rep.get("online") or {}).get("ndcg@10_discounted")),
        "interactions": interactions[-1] if interactions else None,
        "wall_s": rep.get("wall_s"),
    }


def make_record(results: dict, name: str, command: str, cost: dict | None = None) -> dict:
    """The record of a complete results.json made by this checkout's code; ``cost``: the
    run's ``wall_s``, ``cpu_s`` and kernel ``threads`` where the runner measured them."""
    if not results.get("complete"):
        raise FoltrError(f"record {name}: the run is not complete; finish it (--resume) first")
    check_same_code(results, name, "record")
    reference = results.get("reference")
    config = results.get("config", {})
    return {
        "run": name,
        "command": command,
        "cost": cost or {},
        "scenario": results.get("scenario"),
        "reference": reference,
        "settings": config.get(reference) or next(iter(config.values()), {}),
        "made": _dt.date.today().isoformat(),
        "code": results.get("code", {}),
        "environment": results.get("environment", {}),
        "files": source_hashes(),
        "variants": {
            v: [_repeat(r) for r in entry["repeats"]] for v, entry in results["variants"].items()
        },
    }


def sample_of(record: dict) -> tuple[int | None, int]:
    """The (fold, seed) a check re-runs: the record's first repeat (fold None: no folds)."""
    first = next(iter(record["variants"].values()))[0]
    return first["fold"], first["seed"]


def repeat_name(fold: int | None, seed: int) -> str:
    return f"seed {seed}" if fold is None else f"fold {fold}, seed {seed}"


def sample_differences(record: dict, sample: dict) -> list[str]:
    """Where ``sample`` (the results of a re-run of some of the record's repeats) differs from
    the record: one line per variant and repeat, naming the first field that differs; a variant
    or repeat of the sample the record lacks is a difference too."""
    out = []
    for variant, entry in sample["variants"].items():
        kept = {(r["fold"], r["seed"]): r for r in record["variants"].get(variant, [])}
        for rep in map(_repeat, entry["repeats"]):
            key = rep["fold"], rep["seed"]
            old = kept.get(key)
            where = f"{variant}, {repeat_name(*key)}"
            if old is None:
                out.append(f"{where}: not in the record")
                continue
            fields = [f for f in rep if f != "wall_s" and rep[f] != old.get(f)]
            if fields:
                out.append(f"{where}: {fields[0]} differs")
    if not any(entry["repeats"] for entry in sample["variants"].values()):
        out.append("the re-run has no repeats")
    return out


def checked_record(record: dict, sample: dict, how: str, cost: dict | None = None) -> dict:
    """``record`` with ``checked``: this checkout's code re-ran ``how`` (results ``sample``)
    and computed every field the record holds of those repeats (``sample_differences`` empty)."""
    if problems := sample_differences(record, sample):
        raise FoltrError(f"record {record['run']}: the re-run differs: {problems[0]}")
    check_same_code(sample, record["run"], "check")
    return {
        **record,
        "checked": {
            "made": _dt.date.today().isoformat(),
            "how": how,
            "code": sample.get("code", {}),
            "files": source_hashes(),
            "cost": cost or {},
        },
    }


def write_record(record: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['run']}.json.gz"
    text = json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n"
    path.write_bytes(gzip.compress(text.encode(), mtime=0))  # the same bytes for the same record
    return path


@dataclass(frozen=True)
class Record:
    name: str
    data: dict
    changed: tuple[str, ...]  #: result-affecting files that differ from the checkout's

    @property
    def stale(self) -> bool:
        return bool(self.changed)

    @property
    def checked(self) -> dict | None:
        """The last check of the record by other code than made it (see the module)."""
        return self.data.get("checked")

    def repeats(self, variant: str) -> list[dict] | None:
        return self.data["variants"].get(variant)


def load_records(folder: Path) -> dict[str, Record]:
    """Every record in ``folder`` by run name, each with the files changed since it was made."""
    now = source_hashes()
    out = {}
    for path in sorted(folder.glob("*.json.gz")):
        try:
            data = json.loads(gzip.decompress(path.read_bytes()))
            files = (data.get("checked") or data)["files"]  # the code last seen to agree
            name = data["run"]
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            raise FoltrError(f"{path}: not a record ({type(e).__name__}: {e})") from None
        changed = sorted({f for f in set(files) | set(now) if files.get(f) != now.get(f)})
        out[name] = Record(name, data, tuple(changed))
    return out
