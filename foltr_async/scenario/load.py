"""Scenario files: TOML -> validated, fully defaulted configs, one per named variant.

A scenario is ``base + variants + repeats``: each ``[variants.NAME]`` table is deep-merged over
the base (lists are replaced whole), then ``--set key=value`` overrides apply to every variant,
then each variant is validated on its own, so an error names the variant it comes from.
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foltr_async.config import (
    SECTION_CLASSES,
    AgentGroup,
    EvaluationSettings,
    RunConfig,
    ScenarioSettings,
    TimelineItem,
)
from foltr_async.errors import DatasetError, ScenarioError
from foltr_async.inputs import MB, nesting_depth, read_capped, relative_note
from foltr_async.names import NAME_MAX, VARIANT_RULE, bad_variant_name, suggest
from foltr_async.params import Field, check_table, fail, key_text
from foltr_async.registry import REGISTRY, unknown

if TYPE_CHECKING:
    from foltr_async.runtime.network import NetworkModel

#: every section's fields, in a variant's order (``[network]`` is checked by NetworkModel)
SECTIONS: dict[str, dict[str, Field]] = {
    **{name: cls.FIELDS for name, cls in SECTION_CLASSES.items() if name != "evaluation"},
    "network": {},
    "evaluation": EvaluationSettings.FIELDS,
}

AGENT_FIELDS = {
    "behaviour": Field(str, help="attacker or eavesdropper kind"),
    "count": Field(int, 1, "agents in this group", min=1),
}
TIMELINE_FIELDS = TimelineItem.FIELDS
#: the largest scenario file read (a scenario is a few kB; a grid a few more)
MAX_SCENARIO_BYTES = 4 * MB
#: how deep a scenario's tables and arrays may nest (real ones: about 6)
MAX_DEPTH = 32
#: what one variant's table holds (and what a ``[variants.NAME]`` table or ``--set`` may set)
VARIANT_LEVEL = (*SECTIONS, "agents", "timeline")
TOP_LEVEL = (*VARIANT_LEVEL, "variants", "grid")


@dataclass(frozen=True)
class Scenario:
    """A loaded scenario: where it came from and one validated config per variant."""

    path: Path
    name: str
    seed: int
    repeats: int
    reference: str | None
    variants: dict[str, RunConfig]
    #: ``dataset.folds``: repeat r runs on fold ``folds[r % len(folds)]`` (``repeats`` counts
    #: folds x seeds); empty: every repeat reads ``dataset.path`` as given.
    folds: tuple[int, ...] = ()

    def where(self, variant: str) -> str:
        """How an error names one variant: ``file [variant NAME]`` (a file without
        ``[variants]`` has the one variant ``default`` and is named by the file alone)."""
        return label(self.path, variant, list(self.variants) != ["default"])

    def settings(self) -> dict[str, dict[str, Any]]:
        """Every variant's plain tables (results.json's ``config``)."""
        return {name: cfg.as_dict() for name, cfg in self.variants.items()}


def label(path: Path, variant: str, named: bool) -> str:
    return f"{path} [variant {key_text(variant)}]" if named else str(path)


def load_scenario(
    path: str | Path, overrides: list[str] = (), seed: int | None = None, only: list[str] = ()
) -> Scenario:
    """The scenario file, every variant validated (``only``: just those variants, so an
    override one of the others refuses, e.g. a FOLtR-ES parameter beside FPDGD variants, can
    still be given to the ones it fits; the reference stays only if among them). Reading a
    file is where a program (the CLI, a worker, a notebook) starts, so the protocols and
    plugins are loaded here, before ``validate`` looks their names up (``validate`` itself
    never loads anything)."""
    from foltr_async.plugins import load_plugins

    path = Path(path)
    where = str(path)
    try:
        raw = tomllib.loads(read_capped(path, MAX_SCENARIO_BYTES, "scenario file").decode())
    except FileNotFoundError:
        raise ScenarioError(f"{where}: no such scenario file") from None
    except OSError as e:
        raise ScenarioError(f"{where}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{where}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{where}: not UTF-8 text") from None
    except ValueError as e:  # read_capped: not a regular file, or too large
        raise ScenarioError(f"{where}: {e}") from None
    except RecursionError:
        raw = None  # the parser's own stack: deeper than any limit below
    if raw is None or nesting_depth(raw, MAX_DEPTH) > MAX_DEPTH:
        raise ScenarioError(f"{where}: nested deeper than {MAX_DEPTH} levels of tables and arrays")
    # after the read: a mistyped file name answers without importing them
    load_plugins(_plugin_modules(raw.pop("plugins", None), where), where)
    check_sections(raw, TOP_LEVEL, where)
    variants_raw = raw.pop("variants", {}) or {}
    if not isinstance(variants_raw, dict):
        raise fail(where, "variants", "a table of named override tables", variants_raw)
    variants_raw = _with_grids(variants_raw, raw.pop("grid", []), where)
    for name in variants_raw:
        if bad_variant_name(name):
            shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
            raise fail(where, "variants", VARIANT_RULE, shown)
    parsed = [_parse_set(s) for s in overrides]
    for (keys, _), text in zip(parsed, overrides, strict=True):
        check_sections({keys[0]: None}, VARIANT_LEVEL, f"--set {text}")
    sets = _with_layout(parsed)
    if seed is not None:
        sets.append((["scenario", "seed"], seed))
    names = list(variants_raw) or ["default"]
    if only:
        unknown = [v for v in only if v not in names]
        if unknown:
            raise ScenarioError(
                f"--only: unknown variant {unknown[0]!r}{suggest(unknown[0], names)}; "
                f"variants: {', '.join(names)}"
            )
        names = [n for n in names if n in only]
    resolved: dict[str, RunConfig] = {}
    for name in names:
        merged = copy.deepcopy(raw)
        over = variants_raw.get(name, {})
        if not isinstance(over, dict):
            raise fail(where, f"variants.{key_text(name)}", "a table of overrides", over)
        _deep_merge(merged, over)
        for keys, value in sets:
            if keys == ["dataset", "profile"] and isinstance(merged.get("dataset"), dict):
                # a profile replaces the file's data: its path, folds and format go with it
                merged["dataset"].pop("path", None)
                merged["dataset"].pop("folds", None)
                merged["dataset"].pop("format", None)
            _set_path(merged, keys)[keys[-1]] = value
        _beside(merged, path.parent)
        where_v = label(path, name, bool(variants_raw))
        try:
            resolved[name] = validate(merged, where_v, default_name=path.stem)
        except ScenarioError as e:
            given = {".".join(keys) for keys, _ in parsed}
            if len(names) > 1 and any(f"{where_v}: {key}:" in str(e) for key in given):
                raise ScenarioError(
                    f"{e} (--set applies to every variant run; --only VARIANT picks those it fits)"
                ) from None
            raise
    first = _scenario_wide(resolved, where)
    reference = first.reference
    if only and reference not in only:
        reference = None
    if reference is not None and reference not in resolved:
        raise ScenarioError(
            f"{where}: scenario.reference: {reference!r} is not a variant"
            f"{suggest(reference, list(resolved))}; variants: {', '.join(resolved)}"
        )
    folds = _folds(resolved, where)
    repeats = first.repeats * max(1, len(folds))
    return Scenario(path, first.name, first.seed, repeats, reference, resolved, folds)


def _plugin_modules(table: Any, where: str) -> list[str]:
    """``[plugins] modules = ["pkg.module", ...]``: the plugin modules the file needs, loaded
    before anything in it is checked (top level only: every variant runs with them)."""
    if table is None:
        return []
    if not isinstance(table, dict) or set(table) - {"modules"}:
        extra = sorted(set(table) - {"modules"}) if isinstance(table, dict) else None
        got = f"plugins.{extra[0]}" if extra else "plugins"
        raise fail(where, got, 'a [plugins] table with one key, modules = ["pkg.module", ...]')
    modules = table.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise fail(where, "plugins.modules", "an array of module names", modules)
    return modules


def _with_layout(sets: list[tuple[list[str], Any]]) -> list[tuple[list[str], Any]]:
    """``--set dataset.path=DIR`` replaces the file's data with a published collection: the
    folds (or one fixed split) and query-level normalisation follow from its layout
    (``foltr_async.ltr.catalog``), so one option moves any scenario onto it; a later
    ``--set dataset.folds=...`` or ``dataset.normalise=...`` still wins. A file path keeps its
    old meaning (that file, ``test.txt`` beside it, no folds); LETOR files of no published
    collection (a written synthetic profile) are read as they are, on their FoldN folders."""
    from foltr_async.ltr.aol import LETOR, METADATA
    from foltr_async.ltr.catalog import NotPublished, recognise

    out: list[tuple[list[str], Any]] = []
    for keys, value in sets:
        out.append((keys, value))
        if keys != ["dataset", "path"] or not isinstance(value, str):
            continue
        if Path(value).is_file():
            out.append((["dataset", "folds"], []))
            continue
        if all((Path(value) / f).is_file() for f in (METADATA, LETOR)):  # AOL4FOLTR: no folds
            continue
        try:
            layout = recognise(value)
        except NotPublished as e:
            out.append((["dataset", "folds"], list(e.folds)))
            continue
        except DatasetError as e:
            raise DatasetError(f"--set dataset.path: {e}{relative_note(value)}") from None
        out[-1] = (keys, str(layout.root))
        out.append((["dataset", "folds"], list(layout.folds)))
        out.append((["dataset", "normalise"], layout.collection.normalise))
    return out


def check_sections(table: dict, known: tuple[str, ...], where: str) -> None:
    """Every top-level key of ``table`` is one of ``known``: the base file, each variant as
    merged from its ``[variants.NAME]`` table or ``[[grid]]`` entry, and every ``--set`` path
    are checked by this one rule, so a misspelt section never runs the defaults."""
    for key in table:
        if key not in known:
            hint = " (only at the top of the file)" if key in TOP_LEVEL else suggest(key, known)
            raise ScenarioError(
                f"{where}: {key_text(key)}: unknown section{hint}; known: {', '.join(known)}"
            )


def _with_grids(variants: dict, grids: Any, where: str) -> dict:
    """The explicit variants, then those the ``[[grid]]`` entries expand to."""
    from foltr_async.scenario.grid import expand_grids

    expanded = expand_grids(grids, where)
    for name in expanded:
        if name in variants:
            raise fail(where, "grid", f"variant names not in [variants], {name!r} is")
    return {**variants, **expanded}


def _scenario_wide(variants: dict[str, RunConfig], where: str) -> ScenarioSettings:
    """The ``[scenario]`` values the whole file shares (one output folder, one seed sequence,
    one reference): a variant setting another one would silently run with the first's."""
    for key in ("name", "seed", "repeats", "reference"):
        values = {name: getattr(cfg.scenario, key) for name, cfg in variants.items()}
        if len(set(values.values())) > 1:
            raise fail(
                where,
                f"scenario.{key}",
                "one value for every variant (set it in the base [scenario] table)",
                values,
            )
    return next(iter(variants.values())).scenario


def _folds(variants: dict[str, RunConfig], where: str) -> tuple[int, ...]:
    """``dataset.folds`` (one list for every variant: folds are paired like seeds)."""
    lists = {tuple(cfg.dataset.folds) for cfg in variants.values()}
    if len(lists) > 1:
        raise fail(where, "dataset.folds", "the same folds in every variant", sorted(lists))
    folds = lists.pop()
    if not folds:
        return ()
    if len(set(folds)) != len(folds):
        raise fail(where, "dataset.folds", "distinct fold numbers", list(folds))
    if any(cfg.dataset.path is None for cfg in variants.values()):
        raise fail(where, "dataset.folds", "a dataset.path holding the FoldN directories")
    return folds


def repeat_config(scenario: Scenario, cfg: RunConfig, repeat: int) -> RunConfig:
    """The config repeat ``repeat`` runs: with folds, ``dataset.path`` names its fold."""
    if not scenario.folds:
        return cfg
    fold = scenario.folds[repeat % len(scenario.folds)]
    return cfg.with_dataset(path=str(Path(cfg.dataset.path) / f"Fold{fold}"), folds=[fold])


def revise(cfg: RunConfig, changes: dict[str, Any], where: str = "revised") -> RunConfig:
    """``cfg`` with ``changes`` (tables as in a ``[variants.NAME]`` table) merged over it and
    checked again: a variant changed from Python (a notebook, a test) passes every rule a file
    does."""
    raw = cfg.as_dict()
    for group in raw["agents"]:
        del group["role"]  # the behaviour's, not a key a file may set
    _deep_merge(raw, changes)
    return validate(raw, where, default_name=cfg.scenario.name)


def validate(raw: dict[str, Any], where: str, default_name: str = "scenario") -> RunConfig:
    """One variant's typed config with every default filled in, or a one-line ScenarioError.

    Names are looked up in the registry as it is: the caller loads the protocols and plugins
    first (``foltr_async.plugins.load_plugins``; ``load_scenario`` does)."""
    registry = REGISTRY
    check_sections(raw, VARIANT_LEVEL, where)
    cfg: dict[str, Any] = {}
    for section, fields in SECTIONS.items():
        if section == "network":
            network_table, network = _network(raw.get(section, {}), where)
            continue
        if section == "federation" and section not in raw:
            raise fail(where, "federation.protocol", "a protocol name (required)")
        cfg[section] = check_table(raw.get(section, {}), fields, where, section)
    name = cfg["scenario"]["name"] = cfg["scenario"]["name"] or default_name
    if (
        name in (".", "..")
        or not name.isprintable()
        or any(c in name for c in "/\\")
        or len(name.encode("utf-8")) > NAME_MAX
    ):
        raise fail(
            where,
            "scenario.name",
            f"a name for one folder (no '/' or '\\', at most {NAME_MAX} bytes)",
            name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)",
        )
    if cfg["dataset"]["format"] == "aol4foltr" and (
        cfg["dataset"]["path"] is None or cfg["dataset"]["folds"]
    ):
        raise fail(
            where,
            "dataset.path",
            "an AOL4FOLTR folder (metadata.csv, letor.txt) and no dataset.folds",
            cfg["dataset"]["path"],
        )
    if cfg["dataset"]["path"] is None:
        from foltr_async.ltr.synthetic import profile_names

        known = list(profile_names())
        if cfg["dataset"]["profile"] not in known:
            raise ScenarioError(
                f"{where}: dataset.profile: unknown profile {cfg['dataset']['profile']!r}"
                f"{suggest(cfg['dataset']['profile'], known)}; known: {', '.join(known)}"
            )
    fed = cfg["federation"]
    proto = registry.protocols.get(fed["protocol"])
    if proto is None:
        raise ScenarioError(
            f"{where}: federation.protocol: "
            + unknown("protocol", fed["protocol"], registry.protocols)
        )
    own = proto.build.own_data
    if cfg["dataset"]["path"] is not None and own is not None:
        raise fail(
            where,
            "dataset.path",
            f"no path: protocol {fed['protocol']!r} learns from {own}, which a learning-to-rank "
            "collection of feature vectors does not hold",
            cfg["dataset"]["path"],
        )
    fed["params"] = check_table(fed["params"], proto.fields, where, "federation.params")
    if fed["aggregator"] not in registry.aggregators:
        raise ScenarioError(
            f"{where}: federation.aggregator: "
            + unknown("aggregator", fed["aggregator"], registry.aggregators)
        )
    _secure_aggregation(fed, where, registry)
    _partition(fed, where, proto)
    agents = tuple(
        _agent_group(g, i, fed["protocol"], where, registry)
        for i, g in enumerate(_list(raw.get("agents", []), where, "agents"))
    )
    n_clients = fed["clients"] + sum(g.count for g in agents if g.role == "attacker")
    if fed["min_clients"] > n_clients:  # no round could ever aggregate
        raise fail(
            where,
            "federation.min_clients",
            f"at most the {n_clients} clients (honest and attackers)",
            fed["min_clients"],
        )
    timeline = tuple(
        _timeline_item(t, i, where, fed["rounds"], proto)
        for i, t in enumerate(_list(raw.get("timeline", []), where, "timeline"))
    )
    run = RunConfig(
        **{name: cls.of(cfg[name]) for name, cls in SECTION_CLASSES.items()},
        network=network,
        network_table=network_table,
        agents=agents,
        timeline=timeline,
        params=proto.params(**fed["params"]),
        partition=REGISTRY.partitioner.params.of(fed["partition"]) if fed["partition"] else None,
    )
    _rules_across_keys(run, proto, where)
    return run


def _rules_across_keys(cfg: RunConfig, proto, where: str) -> None:
    """What the variant's protocol can run (logged data, FLGo's completeness), then the
    protocol's own rules across keys (``ProtocolRun.check``), the partitioner's
    (``PartitionEntry.check``) and each agent group's (``BehaviourEntry.check``)."""
    run, name = proto.build, proto.name
    if cfg.dataset.replayed:
        if not run.replays:
            raise fail(
                where,
                "dataset.format",
                f"'letor' for protocol {name!r}, which does not replay logged queries (the "
                "replaying protocols: fpdgd, fpdgd_async)",
            )
        if cfg.federation.partition:
            raise fail(
                where,
                "federation.partition",
                "no table with dataset.format = 'aol4foltr' (the log is the partition)",
            )
        if cfg.network.flgo is not None:
            raise fail(
                where,
                "network.flgo",
                "no FLGo system model with dataset.format = 'aol4foltr' (the log decides "
                "when and how much each client trains)",
            )
    flgo = cfg.network.flgo
    if flgo is not None and flgo.completeness != "IDL" and not run.completes:
        raise fail(
            where,
            "network.flgo.completeness",
            f"'IDL' for protocol {name!r}, whose clients' local work is not cut short",
            flgo.completeness,
        )
    try:
        run.check(cfg)
        partitioner = REGISTRY.partitioner
        if cfg.partition is not None and partitioner.check is not None:
            partitioner.check(cfg)
        for group in cfg.agents:
            behaviour = REGISTRY.behaviours[group.behaviour]
            if behaviour.check is not None:
                behaviour.check(cfg, group)
    except ScenarioError as e:
        raise ScenarioError(f"{where}: {e}") from None


def _secure_aggregation(fed: dict[str, Any], where: str, registry) -> None:
    """Resolve ``secure_aggregation`` (a ``[federation.secagg]`` table alone turns it on), check
    the table against the scheme's fields and the protocol / aggregator against the scheme."""
    from foltr_async.runtime import secure

    on = fed["secure_aggregation"]
    fed["secure_aggregation"] = on = bool(fed["secagg"]) if on is None else on
    fed["secagg"] = check_table(fed["secagg"], registry.scheme().fields, where, "federation.secagg")
    if on:
        secure.check_config(fed, registry, registry.aggregators[fed["aggregator"]].robust, where)


def _partition(fed: dict[str, Any], where: str, proto) -> None:
    """Check ``[federation.partition]`` against the registered partitioner's fields and that
    the protocol's clients read per-client data."""
    if not fed["partition"]:
        return
    if not proto.build.partitions:
        raise fail(
            where,
            "federation.partition",
            f"no table: protocol {proto.name!r} does not read per-client data",
        )
    entry = REGISTRY.partitioner
    if entry is None:
        raise fail(where, "federation.partition", "no table: no partitioner is registered")
    fed["partition"] = check_table(fed["partition"], entry.fields, where, "federation.partition")


def _agent_group(group: Any, i: int, protocol: str, where: str, registry) -> AgentGroup:
    path = f"agents[{i}]"
    if not isinstance(group, dict):
        raise fail(where, path, "a table", group)
    name = group.get("behaviour")
    entry = registry.behaviours.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ScenarioError(
            f"{where}: {path}.behaviour: {unknown('behaviour', name, registry.behaviours)}"
        )
    if protocol not in entry.protocols:
        raise ScenarioError(
            f"{where}: {path}.behaviour: {name!r} does not speak protocol {protocol!r} "
            f"(it speaks {', '.join(entry.protocols)})"
        )
    out = check_table(group, {**AGENT_FIELDS, **entry.fields}, where, path)
    return AgentGroup(out["behaviour"], out["count"], entry.role, entry.params.of(out), out)


def _timeline_item(item: Any, i: int, where: str, rounds: int, proto) -> TimelineItem:
    path = f"timeline[{i}]"
    out = check_table(item, TIMELINE_FIELDS, where, path)
    takes = proto.build.takes()
    if out["action"] not in takes:
        raise ScenarioError(
            f"{where}: {path}.action: {out['action']!r} is not an action of protocol "
            f"{proto.name!r}{suggest(out['action'], list(takes))} (its actions: "
            f"{', '.join(takes)})"
        )
    if (out["round"] is None) == (out["time"] is None):
        raise fail(where, path, "exactly one of 'round' or 'time'")
    if out["round"] is not None:
        r = out["round"] + rounds + 1 if out["round"] < 0 else out["round"]
        if not 1 <= r <= rounds:
            raise fail(
                where, f"{path}.round", f"a round in 1..{rounds} or -{rounds}..-1", out["round"]
            )
        out["round"] = r
    if not all(isinstance(a, str) for a in out["agents"]) or not out["agents"]:
        raise fail(
            where, f"{path}.agents", "a non-empty list of agent ids or group names", out["agents"]
        )
    return TimelineItem.of(out)


def _network(table: Any, where: str) -> tuple[dict[str, Any], NetworkModel]:
    from foltr_async.runtime.network import NetworkModel

    if not isinstance(table, dict):
        raise fail(where, "network", "a table", table)
    try:
        return table, NetworkModel.from_dict(table)
    except ScenarioError as e:
        raise ScenarioError(f"{where}: {e}") from None


def _beside(raw: dict[str, Any], folder: Path) -> None:
    """A relative ``network.trace`` not found from the current folder is read from the scenario
    file's folder (shipped scenarios name their traces that way)."""
    net = raw.get("network")
    trace = net.get("trace") if isinstance(net, dict) else None
    if isinstance(trace, str) and not Path(trace).exists() and (folder / trace).exists():
        net["trace"] = str(folder / trace)


def _list(value: Any, where: str, path: str) -> list:
    if not isinstance(value, list):
        raise fail(where, path, f"an array of tables ([[{path}]])", value)
    return value


def _deep_merge(base: dict, over: dict) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def _set_path(cfg: dict, keys: list[str]) -> dict:
    node = cfg
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ScenarioError(f"--set {'.'.join(keys)}: {key} is not a table")
    return node


def _parse_set(text: str) -> tuple[list[str], Any]:
    """``key.path=value`` with a TOML value (``rounds=50``, ``clicks.model="perfect"``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ScenarioError(f"--set {text!r}: expected key.path=value")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value  # bare words are strings: --set clicks.model=perfect
    except RecursionError:
        parsed = None
    keys = key.strip().split(".")
    if parsed is None or len(keys) + nesting_depth(parsed, MAX_DEPTH) > MAX_DEPTH:
        raise ScenarioError(
            f"--set {text[:60]!r}: nested deeper than {MAX_DEPTH} levels of tables and arrays"
        )
    return keys, parsed
