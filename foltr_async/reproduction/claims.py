"""Published claims the project tests, read from ``reproduce/claims/claims.toml``.

A claim is a finding as a seed text states it (file, place, lines, the quote) and what it means
operationally: which arms of which recorded runs are compared, on which metric at which round,
in which direction, and whether the study reported the difference as significant. Every key is
typed and checked; a bad file gets one line naming the key. ``check_quotes`` holds each quote
against the seed text, so a claim cannot quote what its source does not say.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from foltr_async.errors import ScenarioError
from foltr_async.params import Field, check_table, param, parameters

#: what a claim expects of ``arm - against``
EXPECT = ("greater", "less", "equal")
#: the metric a claim may read: an offline metric of the record, or the online one
ONLINE = "online"


@parameters
class Study:
    title: str = param(help="short name of the study")
    file: str = param("", help="seed file name in the seeds folder")
    repository: str = param(
        "",
        help="for a study whose text is not among the seeds: the public repository (owner/name) "
        "whose figures its claims are read from",
    )


@parameters
class Topic:
    title: str = param(help="the report's section heading for the claims of this topic")


@parameters
class Source:
    place: str = param(help="section, table or figure of the seed")
    lines: list = param([], help="[first, last] line of the quote", items=Field(int, min=1))


@parameters
class Comparison:
    arm: str = param(help="the variant the finding is about")
    against: str = param(help="the variant it is compared with (the arm itself for learning)")
    against_round: int | None = param(
        None, help="read the against side at this round instead of the claim's (0: the last)", min=0
    )


@parameters
class ClaimSpec:
    id: str = param(help="short unique id, used in the report and by --check")
    study: str = param(help="a key of [studies]")
    topic: str = param(help="a key of [topics]: the report's section it is in")
    title: str = param(help="the claim in a few words, for the report's table")
    source: dict = param(help="place and lines in the seed")
    finding: str = param(help="the finding, quoted from the seed (whitespace may differ)")
    published: str = param(help="the published number or finding in short, for the table")
    expect: str = param(help="arm - against is expected so", choices=EXPECT)
    published_significant: bool | None = param(
        None, help="whether the seed reports the difference as significant (none: no test given)"
    )
    published_effect: float | None = param(
        None, help="size of the published difference in the metric, from the seed's numbers", min=0
    )
    metric: str = param("ndcg@10", help="offline metric of the records, or 'online'")
    round: int = param(0, help="the evaluation read: 0 = the last, else that round", min=0)
    runs: list = param([], help="the records that answer it", items=Field(str))
    comparisons: list = param([], help="[{arm, against}, ...]", items=Field(dict))
    family: int = param(0, help="Bonferroni's m; 0 = the claim's comparisons per run", min=0)
    alpha: float = param(0.05, help="significance level", min=0.0, max=0.5)
    departures: list = param(
        [], help="how the runs depart from the published setting", items=Field(str)
    )
    not_comparable: str = param("", help="why no run can answer it (empty: comparable)")


@dataclass(frozen=True)
class Claim:
    spec: ClaimSpec
    study: Study
    source: Source
    comparisons: tuple[Comparison, ...]
    line: int  #: where its [[claim]] table starts in the claims file

    def __getattr__(self, name: str):  # the spec's fields read as the claim's own
        return getattr(self.spec, name)


@dataclass(frozen=True)
class ClaimSet:
    path: Path
    studies: dict[str, Study]
    topics: dict[str, Topic]
    claims: tuple[Claim, ...]


def load_claims(path: Path) -> ClaimSet:
    """The claims file, every key checked; errors name the file, the claim and the key."""
    try:
        text = path.read_text(encoding="utf-8")
        doc = tomllib.loads(text)
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: not valid TOML: {e}") from None
    unknown = set(doc) - {"studies", "topics", "claim"}
    if unknown:
        raise ScenarioError(
            f"{path}: unknown top-level key {sorted(unknown)[0]!r}; "
            "expected [studies], [topics] and [[claim]]"
        )
    studies = {
        key: Study.of(check_table(table, Study.FIELDS, str(path), f"studies.{key}"))
        for key, table in doc.get("studies", {}).items()
    }
    for key, study in studies.items():
        if bool(study.file) == bool(study.repository):
            raise ScenarioError(
                f"{path}: studies.{key}: expected a seed file or a repository, one of them"
            )
    topics = {
        key: Topic.of(check_table(table, Topic.FIELDS, str(path), f"topics.{key}"))
        for key, table in doc.get("topics", {}).items()
    }
    starts = [i + 1 for i, ln in enumerate(text.splitlines()) if ln.strip() == "[[claim]]"]
    claims: list[Claim] = []
    seen: set[str] = set()
    for i, table in enumerate(doc.get("claim", [])):
        where = f"{path}:{starts[i] if i < len(starts) else '?'}"
        spec = ClaimSpec.of(check_table(table, ClaimSpec.FIELDS, where, "claim"))
        if spec.id in seen:
            raise ScenarioError(f"{where}: claim.id: {spec.id!r} is used twice")
        seen.add(spec.id)
        for key, known in (("study", studies), ("topic", topics)):
            if getattr(spec, key) not in known:
                raise ScenarioError(
                    f"{where}: claim.{key}: expected one of "
                    f"{', '.join(sorted(known)) or f'the [{key}s] keys'}, "
                    f"got {getattr(spec, key)!r}"
                )
        source = Source.of(check_table(spec.source, Source.FIELDS, where, "claim.source"))
        if studies[spec.study].repository:  # read from a figure: no lines to quote
            if source.lines:
                raise ScenarioError(
                    f"{where}: claim.source.lines: expected none for study {spec.study!r}, "
                    "whose findings are read from its repository's figures"
                )
        elif len(source.lines) != 2 or source.lines[0] > source.lines[1]:
            raise ScenarioError(
                f"{where}: claim.source.lines: expected [first, last], got {source.lines!r}"
            )
        comps = tuple(
            Comparison.of(check_table(c, Comparison.FIELDS, where, f"claim.comparisons[{j}]"))
            for j, c in enumerate(spec.comparisons)
        )
        if not spec.not_comparable and not (comps and spec.runs):
            raise ScenarioError(
                f"{where}: claim {spec.id!r}: expected runs and comparisons, "
                "or not_comparable with the reason"
            )
        claims.append(Claim(spec, studies[spec.study], source, comps, starts[i]))
    return ClaimSet(path, studies, topics, tuple(claims))


def _words(text: str) -> str:
    """Text with every run of whitespace one space and typographic quotes and dashes plain: a
    flattened PDF breaks lines and hyphenates where a quote does not."""
    table = str.maketrans(
        {
            "\u2018": "'",
            "\u2019": "'",
            "\u201c": '"',
            "\u201d": '"',
            "\u2013": "-",
            "\u2014": "-",
            "\u2212": "-",
        }
    )
    return re.sub(r"\s+", " ", text.translate(table)).strip()


def check_quotes(claims: ClaimSet, seeds: Path) -> list[str]:
    """One line per claim whose quote is not in its seed file at the lines it names (a
    ``...`` in a quote stands for left-out words); empty when every quote is there."""
    problems = []
    cache: dict[str, list[str]] = {}
    for c in claims.claims:
        if not c.study.file:  # a reading of a repository's figure, not a quote
            continue
        seed = seeds / c.study.file
        if c.study.file not in cache:
            try:
                cache[c.study.file] = seed.read_text(encoding="utf-8").splitlines()
            except OSError:
                problems.append(f"{claims.path}:{c.line}: {c.id}: seed {seed} cannot be read")
                cache[c.study.file] = []
                continue
        lines = cache[c.study.file]
        first, last = c.source.lines
        if last > len(lines):
            problems.append(
                f"{claims.path}:{c.line}: {c.id}: source.lines {first}-{last} "
                f"past the end of {c.study.file} ({len(lines)} lines)"
            )
            continue
        # a line-broken hyphenation ("signifi-\ncantly") joins as the reader reads it
        window = _words(re.sub(r"-\n(?=[a-z])", "", "\n".join(lines[first - 1 : last])))
        pos = 0
        for part in (_words(p) for p in c.finding.split("...") if p.strip()):
            at = window.find(part, pos)
            if at < 0:
                problems.append(
                    f"{claims.path}:{c.line}: {c.id}: the finding is not at lines "
                    f"{first}-{last} of {c.study.file}: {part[:60]!r}"
                )
                break
            pos = at + len(part)
    return problems
