"""One results folder from runs of one scenario made in parts (``--only`` on one machine and
another, or a variant added later), as if a single run had made them.

Repeat ``r`` of every variant runs with seed ``scenario.seed + r``, so the parts pair up by
seed: summaries, the paired tests against the reference and their Holm correction are
computed over the whole family, which separate tables cannot give. A part run with a later
``--seed`` adds seeds: its repeat ``r`` is the merged run's repeat ``seed - first seed + r``
(with ``dataset.folds`` on the fold that repeat would have, checked), so a run of seeds 1-5
and one of seeds 6-25 merge into the 25-run study. A variant two parts both ran must agree,
repeat by repeat, on its settings (apart from the ``[scenario]`` table's seed and repeats) and
final metric, and parts whose results say which code made them (``code``) must name the same;
otherwise nothing is written.
"""

from __future__ import annotations

import math
from pathlib import Path

from foltr_async.config import recorded_data_seed
from foltr_async.errors import FoltrError
from foltr_async.experiment import conclusions
from foltr_async.names import VARIANT_RULE, bad_variant_name
from foltr_async.observe.results import OWN_KEYS, ResultsWriter, final_value, load_results

#: how far the same repeat's final metric may differ between two parts (float noise only)
AGREE = 1e-9


def merge_runs(parts: list[Path], out: Path) -> dict:
    """Write the merged results of ``parts`` into ``out`` (results.json, curves.csv, summary.md,
    the figures); returns the merged results."""
    if len(parts) < 2:
        raise FoltrError("merge: give at least two run folders")
    runs = [(str(p), load_results(p)) for p in parts]
    first_label, first = runs[0]
    for label, res in runs:
        if not isinstance(res.get("seed"), int):
            raise FoltrError(f"{label}: no scenario seed recorded")
    base = min(res["seed"] for _, res in runs)
    for label, res in runs[1:]:
        for key in ("scenario", "metric"):
            if res.get(key) != first.get(key):
                raise FoltrError(
                    f"{label}: {key} = {res.get(key)!r}, but {first_label} has "
                    f"{first.get(key)!r}: not parts of one scenario run"
                )
    _check_same_data(runs)
    code = _common_code(runs)
    references = {res["reference"] for _, res in runs if res.get("reference")}
    if len(references) > 1:
        raise FoltrError(f"merge: the parts name different references: {sorted(references)}")
    metric = first.get("metric", "ndcg@10")
    config, repeats, owner = {}, {}, {}
    for label, res in runs:
        offset = res["seed"] - base
        for name, entry in res["variants"].items():
            if bad_variant_name(name):  # it becomes a row of summary.md
                raise FoltrError(f"{label}: variant {name!r}: expected {VARIANT_RULE}")
            cfg = (res.get("config") or {}).get(name)
            if name in config and _setting(cfg) != _setting(config[name]):
                raise FoltrError(
                    f"variant {name}: its settings differ between {owner[name]} and {label} "
                    f"({_difference(_setting(config[name]), _setting(cfg))})"
                )
            config.setdefault(name, cfg)
            owner.setdefault(name, label)
            mine = repeats.setdefault(name, {})
            for rep in entry["repeats"]:
                if not isinstance(rep.get("repeat"), int):
                    raise FoltrError(f"{label}: variant {name}: a repeat without its index")
                r = rep["repeat"] + offset
                if offset:
                    rep = {**rep, "repeat": r}
                    _check_fold(name, rep, cfg, label)
                if r in mine:
                    _check_same(name, r, metric, mine[r], rep, owner[name], label)
                else:
                    mine[r] = rep
    # each part's kernel threads and cores: results do not depend on them, so parts run with
    # other counts pair; one record if they agree, else each distinct one
    extra, environments = {}, []
    for label, res in runs:
        if "environment" in res and res["environment"] not in environments:
            environments.append(res["environment"])
        for key, value in res.items():
            if key in OWN_KEYS or key in ("interrupted", "environment"):  # both set below
                continue
            if key in extra and extra[key] != value:
                raise FoltrError(f"merge: the parts disagree on {key!r} ({label})")
            extra[key] = value
    if environments:
        extra["environment"] = environments[0] if len(environments) == 1 else environments
    planned = [(res["seed"] - base, res.get("planned") or {}) for _, res in runs]
    n = max((off + (p.get("repeats") or 0) for off, p in planned if p.get("repeats")), default=0)
    config = {name: _as_one_run(cfg, base, n) for name, cfg in config.items()}
    writer = ResultsWriter(
        out,
        scenario=first["scenario"],
        seed=base,
        config=config,
        reference=next(iter(references), None),
        metric=metric,
        conclusions=conclusions,
        code=code,
    )
    writer.run_started(
        {
            "variants": list(repeats),
            "repeats": n or None,
            "rounds": {k: v for _, p in planned for k, v in (p.get("rounds") or {}).items()},
        }
    )
    for name, mine in repeats.items():
        for r in sorted(mine):
            writer.add(name, r, mine[r])
    # complete when every planned repeat of every variant is here, whichever part ran it (a
    # part that lost a repeat, with the variant run again, merges into a complete run)
    if n:
        complete = all(set(range(n)) <= set(mine) for mine in repeats.values())
    else:  # results without their plan
        complete = all(res.get("complete") for _, res in runs)
    writer.run_done(extra if complete else {**extra, "interrupted": True})
    return writer.results


def _common_code(runs: list[tuple[str, dict]]) -> dict | None:
    """The parts' code stamp: parts that carry one must name the same source; the merge
    carries it only when every part does (a part made before stamps could be other code)."""
    stamps = [(label, res.get("code")) for label, res in runs]
    known = [(label, s) for label, s in stamps if s]
    for label, s in known[1:]:
        if s.get("source") != known[0][1].get("source"):
            raise FoltrError(
                f"{label}: made by other code than {known[0][0]} (source {s.get('source')} vs "
                f"{known[0][1].get('source')}): not parts of one run"
            )
    return known[0][1] if known and len(known) == len(stamps) else None


def _setting(cfg: object) -> object:
    """A variant's settings without the ``[scenario]`` table (its seed and repeats say which
    repeats a part ran, not what a repeat computes)."""
    return {k: v for k, v in cfg.items() if k != "scenario"} if isinstance(cfg, dict) else cfg


def _check_same_data(runs: list[tuple[str, dict]]) -> None:
    """Parts of other seeds ran on the same data only if no variant draws its data from the
    scenario seed (a synthetic profile or AOL users without ``dataset.seed``)."""
    seeds = {res["seed"] for _, res in runs}
    if len(seeds) == 1:
        return
    for label, res in runs:
        for name, cfg in (res.get("config") or {}).items():
            if not (isinstance(cfg, dict) and isinstance(cfg.get("dataset"), dict)):
                raise FoltrError(f"{label}: variant {name} has no dataset settings recorded")
            if recorded_data_seed(cfg) is not None and cfg["dataset"].get("seed") is None:
                raise FoltrError(
                    f"{label}: variant {name} draws its data from the scenario seed "
                    f"({res['seed']}; the parts have seeds {sorted(seeds)}), so parts of other "
                    "seeds ran on other data: set dataset.seed to run a scenario in seed ranges"
                )


def _folds(cfg: object) -> list | None:
    dataset = cfg.get("dataset") if isinstance(cfg, dict) else None
    folds = dataset.get("folds") if isinstance(dataset, dict) else None
    return folds if isinstance(folds, list) and folds else None


def _check_fold(name: str, rep: dict, cfg: object, label: str) -> None:
    """A repeat of a later-seeded part, renumbered: with folds it must have run on the fold the
    merged run gives its number (the runner's ``folds[repeat % len(folds)]``)."""
    folds = _folds(cfg)
    if folds is None or "fold" not in rep:
        return
    want = folds[rep["repeat"] % len(folds)]
    if rep["fold"] != want:
        raise FoltrError(
            f"{label}: variant {name}, seed {rep.get('seed')}: ran on fold {rep['fold']}, but as "
            f"repeat {rep['repeat']} of the merged run it would be on fold {want} (the earlier "
            f"parts' repeats must be a multiple of the {len(folds)} folds)"
        )


def _as_one_run(cfg: object, seed: int, n: int) -> object:
    """A variant's settings as the one run the merge stands for: its first seed, and as many
    repeats (a fold's share of them, with folds) as the parts planned together."""
    if not isinstance(cfg, dict) or not isinstance(cfg.get("scenario"), dict) or not n:
        return cfg
    folds = _folds(cfg)
    per = n // len(folds) if folds and n % len(folds) == 0 else n
    return {**cfg, "scenario": {**cfg["scenario"], "seed": seed, "repeats": per}}


def _check_same(name: str, r: int, metric: str, a: dict, b: dict, la: str, lb: str) -> None:
    """The same repeat in two parts (the same seed): the same final metric, to float noise."""
    va, vb = final_value(a, metric), final_value(b, metric)
    if va is None or vb is None or not math.isclose(va, vb, rel_tol=0, abs_tol=AGREE):
        raise FoltrError(
            f"variant {name} repeat {r} (seed {a.get('seed')}): final {metric} {va} in {la} but "
            f"{vb} in {lb}; not the same code or data, so the parts cannot be paired"
        )


def _difference(a: object, b: object, key: str = "") -> str:
    """The first setting two configs disagree on, as ``key: a vs b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _difference(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))
    return f"{key or 'config'}: {a!r} vs {b!r}"
