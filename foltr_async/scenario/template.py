"""``new NAME --protocol P``: a minimal, commented scenario file that runs as written.

The file is made from the registry, so it fits every protocol a plugin adds too: the protocol's
own parameters are listed (commented out, at their defaults, with their help), and the sections
a first experiment changes are shown with the values that make a run of seconds.
"""

from __future__ import annotations

import json
from typing import Any

from foltr_async.errors import FoltrError
from foltr_async.params import _REQUIRED
from foltr_async.registry import Registry, unknown

#: small enough to run in seconds on a laptop core, large enough to learn something
ROUNDS, CLIENTS, QUERIES = 20, 10, 400


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def scenario_text(name: str, protocol: str, registry: Registry) -> str:
    """The scenario file ``new`` writes for ``protocol`` (a one-line error if unknown)."""
    entry = registry.protocols.get(protocol)
    if entry is None:
        raise FoltrError(f"new --protocol: {unknown('protocol', protocol, registry.protocols)}")
    # a protocol with its own data (CS-F-LTR's parties, each a text corpus) costs far more
    # per client: two parties make the run of seconds
    clients = 2 if entry.build.own_data else CLIENTS
    params = []
    for key, f in entry.fields.items():
        if f.default is _REQUIRED:
            raise FoltrError(f"new --protocol {protocol}: its parameter {key} has no default")
        value = "" if f.default is None else _toml(f.default)
        line = f"# {key} = {value}" if value else f"# {key} =  (unset by default)"
        params.append(f"{line:<40} # {f.help}" if f.help else line)
    data = (
        f"# the protocol brings its own data ({entry.build.own_data}): no [dataset] needed\n"
        if entry.build.own_data
        else (
            "[dataset]\n"
            "# an embedded synthetic collection (`foltr-async list` names the profiles); for a\n"
            '# published one give its folder instead: path = "data/MQ2008" (a relative path is\n'
            "# read from the folder you run in; `foltr-async dataset check DIR` checks it)\n"
            'profile = "mq2007-like"\n'
            f"n_queries = {QUERIES}\n"
        )
    )
    return f"""\
# {name}: a scenario of your own (made by `foltr-async new {name} --protocol {protocol}`).
# Check it:  foltr-async validate {name}.toml
# Run it:    foltr-async {name}.toml          (results in results/{name}/<time>/)
# What each part means: docs/SCENARIOS.md; `foltr-async list` names the protocols,
# aggregators, attacks and dataset profiles.

[scenario]
name = "{name}"
description = "What does this experiment ask? (shown in the results and the summary)"
seed = 1
repeats = 2              # runs per variant, seeds 1, 2, ...: variants of one repeat share it
reference = "baseline"   # the variant the others are compared with (paired tests)

{data}
[federation]
protocol = "{protocol}"   # {entry.help}
clients = {clients}
rounds = {ROUNDS}

[federation.params]
# {protocol}'s own parameters, at their defaults (uncomment one to change it):
{chr(10).join(params) if params else "# (none)"}

[evaluation]
every = 5                # evaluate the global model on the held-out queries every 5 rounds

# Each [variants.NAME] table is merged over everything above: one run per variant and repeat.
[variants.baseline]

[variants.more-clients]
federation = {{ clients = {2 * clients} }}
"""
