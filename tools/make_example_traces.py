"""Write the small example traces in scenarios/traces/ (deterministic; rerun to regenerate).

They follow the published formats (see foltr_async/runtime/traces.py) with made-up values of
realistic shape: FedScale-style device capacities (lognormal ms per sample around 100 ms,
kbit/s around 5 Mbit/s) and on/off windows over a compressed 1,200 s "day", and FLGo-style
per-client state variables (availability transition probabilities, latency in time units).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "scenarios" / "traces"
N = 40
CYCLE = 1200.0


def fedscale(rng: np.random.Generator) -> dict:
    device, behaviour = {}, {}
    for i in range(N):
        cid = str(1000 + 7 * i)  # trace ids are arbitrary integers, as in FedScale's files
        device[cid] = {
            "computation": round(float(100.0 * rng.lognormal(0.0, 0.8)), 1),
            "communication": round(float(5000.0 * rng.lognormal(0.0, 1.0)), 1),
        }
        # one to three online windows per cycle, covering about 30-90 % of it
        k = int(rng.integers(1, 4))
        cuts = np.sort(rng.uniform(0.0, CYCLE, 2 * k))
        active, inactive = cuts[0::2], cuts[1::2]
        behaviour[cid] = {
            "active": [round(float(a), 1) for a in active],
            "inactive": [round(float(b), 1) for b in inactive],
            "finish_time": CYCLE,
            "duration": round(float((inactive - active).sum()), 1),
            "model": "example",
        }
    return {"format": "fedscale", "device": device, "behaviour": behaviour}


def flgo(rng: np.random.Generator) -> dict:
    clients = {}
    for i in range(N):
        up = float(rng.uniform(0.5, 0.9))  # long-run share of time online
        p_on = float(rng.uniform(0.1, 0.5))
        clients[str(i)] = {
            "prob_available": round(p_on, 4),
            "prob_unavailable": round(p_on * (1.0 - up) / up, 4),
            "latency": int(max(1, round(10 * rng.lognormal(0.0, 0.7)))),
        }
    return {"format": "flgo", "clients": clients}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    fs = fedscale(rng)
    (OUT / "fedscale_example.json").write_text(json.dumps(fs, indent=1) + "\n")
    with open(OUT / "fedscale_devices.csv", "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["client_id", "computation", "communication"])
        for cid, d in fs["device"].items():
            w.writerow([cid, d["computation"], d["communication"]])
    (OUT / "flgo_example.json").write_text(json.dumps(flgo(rng), indent=1) + "\n")


if __name__ == "__main__":
    main()
