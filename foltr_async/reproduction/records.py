"""Results of record: the compact summary of a finished reproduction run that claims are
computed from, committed under ``reproduce/claims/records/``.

A record keeps, per variant and repeat (fold, seed), the evaluated rounds with their offline
metrics, the online metric through each evaluation and the interactions: everything a claim
reads, a few hundred kB for the largest run. It also keeps what made it: the scenario file and
overrides, the reference variant's settings, the code stamp and a hash of every source file
that can change a result. A record whose files differ from the checkout's is *stale*: the code
that made it is not the code that would make it now.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

from foltr_async.errors import FoltrError
from foltr_async.provenance import check_same_code, source_hashes


def _repeat(rep: dict) -> dict:
    return {
        "fold": rep.get("fold"),
        "seed": rep["seed"],
        "rounds": rep.get("rounds", []),
        "offline": rep.get("offline", {}),
        "online_at": rep.get("online_at", []),
        "online": (rep.get("online") or {}).get("ndcg@10_discounted"),
        "interactions": rep.get("interactions", []),
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


def write_record(record: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['run']}.json"
    path.write_text(json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n")
    return path


@dataclass(frozen=True)
class Record:
    name: str
    data: dict
    changed: tuple[str, ...]  #: result-affecting files that differ from the checkout's

    @property
    def stale(self) -> bool:
        return bool(self.changed)

    def repeats(self, variant: str) -> list[dict] | None:
        return self.data["variants"].get(variant)


def load_records(folder: Path) -> dict[str, Record]:
    """Every record in ``folder`` by run name, each with the files changed since it was made."""
    now = source_hashes()
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            files = data["files"]
            name = data["run"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FoltrError(f"{path}: not a record ({type(e).__name__}: {e})") from None
        changed = sorted({f for f in set(files) | set(now) if files.get(f) != now.get(f)})
        out[name] = Record(name, data, tuple(changed))
    return out
