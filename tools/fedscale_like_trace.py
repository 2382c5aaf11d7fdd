"""A synthetic FedScale-shaped trace (made-up values, not FedScale's data) and its online share.

FedScale's own ``client_device_capacity`` / ``client_behave_trace`` files are not shipped here,
so this writes two pickles in their published layout with a shape like theirs: a cycle of
days, each client online only in sparse windows (a nightly charging session on most nights,
a few short daytime ones), device speeds and bandwidths spread over orders of magnitude. It
then imports them the way a user would (``traces import fedscale``, through the data-only
unpickler), measures with the simulator's own network model which share of the imported
clients is online at each simulated time (``trace_speed`` 1: simulated = trace seconds), and
draws docs/img/fedscale_like_online.png.

    python tools/fedscale_like_trace.py [--out DIR] [--png docs/img/fedscale_like_online.png]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from foltr_async.runtime.network import NetworkModel  # noqa: E402
from foltr_async.runtime.trace_import import import_fedscale  # noqa: E402

DAY = 86400.0
DAYS = 7
N_DEVICE, N_BEHAVIOUR = 5000, 2000  # the two tables differ in size, as FedScale's do
MODELS = ("SM-G9600", "CPH1801", "Redmi Note 8", "Pixel 3a", "moto g(7)")


def device_table(rng: np.random.Generator) -> dict:
    """ms per sample around 100 (lognormal), kbit/s around 5 Mbit/s (lognormal)."""
    comp = 100.0 * rng.lognormal(0.0, 0.8, N_DEVICE)
    comm = 5000.0 * rng.lognormal(0.0, 1.0, N_DEVICE)
    return {
        k + 1: {"computation": float(c), "communication": float(b)}
        for k, (c, b) in enumerate(zip(comp, comm, strict=True))
    }


def sessions(rng: np.random.Generator) -> list[tuple[float, float]]:
    """One client's online windows over the cycle: a night session (charging, on Wi-Fi) on
    60% of nights around 23:00 in its time zone, and Poisson(0.5) short daytime ones a day."""
    tz = rng.normal(0.0, 3.0) * 3600.0
    out = []
    for d in range(DAYS):
        if rng.random() < 0.6:
            start = d * DAY + 23 * 3600.0 + tz + rng.normal(0.0, 1.5) * 3600.0
            out.append((start, start + 2700.0 * rng.lognormal(0.0, 0.8)))
        for _ in range(rng.poisson(0.5)):
            start = d * DAY + rng.uniform(8, 22) * 3600.0 + tz
            out.append((start, start + 480.0 * rng.lognormal(0.0, 0.7)))
    cycle = DAYS * DAY
    merged: list[list[float]] = []
    for a, b in sorted((max(0.0, a % cycle), min(cycle, a % cycle + (b - a))) for a, b in out):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def behaviour_table(rng: np.random.Generator) -> dict:
    """FedScale's entry layout: active / inactive (int seconds), finish_time, duration, model."""
    table = {}
    for k in range(N_BEHAVIOUR):
        win = sessions(rng)
        table[k + 1] = {
            "duration": int(sum(b - a for a, b in win)),
            "inactive": [int(b) for _, b in win],
            "finish_time": int(DAYS * DAY),
            "active": [int(a) for a, _ in win],
            "model": MODELS[int(rng.integers(len(MODELS)))],
        }
    return table


def online_share(path: Path, n: int, times: np.ndarray) -> np.ndarray:
    """Share of the n clients the simulator's network model has online at each time."""
    net = NetworkModel.from_dict({"trace": str(path), "availability_model": "trace"})
    ids = [f"client-{i:04d}" for i in range(n)]
    rng = np.random.default_rng(0)  # unused by on/off windows
    return np.array([len(net.online(ids, 1, rng, now=float(t))) / n for t in times])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for the pickles (default: a temporary one)")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "fedscale_like_online.png")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="fedscale-like-"))
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    device, behaviour = out / "client_device_capacity", out / "client_behave_trace"
    device.write_bytes(pickle.dumps(device_table(rng)))
    behaviour.write_bytes(pickle.dumps(behaviour_table(rng)))

    times = np.arange(0.0, DAYS * DAY, 300.0)
    shares, nobody = {}, {}
    for n in (20, 200):
        trace = out / f"imported-{n}.json"
        trace.unlink(missing_ok=True)
        import_fedscale(device, behaviour, trace, clients=n, seed=0)
        shares[n] = online_share(trace, n, times)
        nobody[n] = float((shares[n] == 0).mean())
        print(
            f"{n} clients: online {100 * shares[n].mean():.2f}% of them on average, "
            f"nobody online {100 * nobody[n]:.1f}% of the time; first 1,200 s: "
            f"nobody online {100 * (shares[n][times < 1200] == 0).mean():.0f}%"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 5.2), sharex=True)
    for ax, n in zip(axes, (200, 20), strict=True):
        ax.fill_between(times / DAY, 100 * shares[n], step="post", color="tab:blue", lw=0)
        ax.set_ylabel("% online")
        ax.set_title(
            f"{n} clients: mean {100 * shares[n].mean():.1f}% online, nobody online "
            f"{100 * nobody[n]:.0f}% of the time",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time (days; trace_start 0, trace_speed 1)")
    fig.suptitle(
        "SYNTHETIC FedScale-shaped trace (tools/fedscale_like_trace.py), imported with "
        "traces import fedscale",
        fontsize=10,
    )
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"pickles in {out}; plot {args.png}")


if __name__ == "__main__":
    main()
