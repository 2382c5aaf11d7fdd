"""Every command the docs show runs: its flags exist, the files it names are there, and a
scenario run's --set / --only / --seed are accepted by the scenario they apply to.

Commands are read from the ```bash blocks of README.md and docs/*.md (a trailing backslash
joins lines; comments are dropped). Words in capitals (RUN, DIR, SERVER) and results/ paths
stand for what the reader's own runs make, so only their flags are checked.
"""

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from foltr_async.cli import COMMANDS
from foltr_async.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
CHOICE = r"\{{[^}}]*\b{}\b[^}}]*\}}"  # a subcommand among a help's {a,b,c}


def commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for block in BLOCK.findall(doc.read_text()):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith(("python -m foltr_async ", "foltr-async ", "python tools/")):
                    out.append((doc.name, line))
    return out


@functools.cache
def help_text(*prog: str) -> str:
    out = subprocess.run(
        [sys.executable, *prog, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return out.stdout + out.stderr


def split(line: str) -> tuple[tuple[str, ...], list[str]]:
    """The program (with its subcommand) and its arguments."""
    words = shlex.split(line)
    if words[0] == "foltr-async":
        words = ["python", "-m", "foltr_async", *words[1:]]
    if words[1] != "-m":
        return (words[1],), words[2:]
    prog, rest = ["-m", "foltr_async"], words[3:]
    if rest and rest[0] in COMMANDS:
        prog.append(rest.pop(0))
        # dataset check, keys init, traces import fedscale: a word the help offers as a choice
        while rest and re.search(CHOICE.format(re.escape(rest[0])), help_text(*prog)):
            prog.append(rest.pop(0))
    return tuple(prog), rest


CASES = commands()


def test_the_docs_show_commands():
    assert len(CASES) > 30 and {doc for doc, _ in CASES} >= {"README.md", "REPRODUCTION-NOTES.md"}


@pytest.mark.parametrize("doc, line", CASES, ids=[f"{d}:{c[:60]}" for d, c in CASES])
def test_a_documented_command_runs(doc, line):
    prog, args = split(line)
    helptext = help_text(*prog)
    for flag in {a.split("=")[0] for a in args if a.startswith("--")}:
        assert re.search(rf"{re.escape(flag)}\b", helptext), f"{doc}: {line}: no flag {flag}"
    for a in args:
        if a.endswith(".toml") and a.startswith(("scenarios/", "reproduce/")) and "*" not in a:
            assert (ROOT / a).is_file(), f"{doc}: {line}: {a} not found"
    if prog == ("-m", "foltr_async") or prog[-1] in ("run", "validate"):
        files = [a for a in args if a.endswith(".toml") and (ROOT / a).is_file()]
        sets = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]
        only = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--only"]
        for f in files[:1]:
            if not any(s.startswith("dataset.path=") for s in sets):  # the reader's own data
                load_scenario(ROOT / f, sets, only=only)
