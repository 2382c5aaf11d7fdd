"""Registries are filled in one place: importing a module installs nothing, ``load_plugins``
installs what each module declares in its ``PROVIDES``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foltr_async.errors import FoltrError
from foltr_async.plugins import BUILTIN, load_plugins

ROOT = Path(__file__).resolve().parents[1]

TABLES = (
    "from foltr_async.registry import REGISTRY\n"
    "from foltr_async.runtime.schema import MESSAGE_KINDS\n"
    "def sizes():\n"
    "    return [len(REGISTRY.protocols), len(REGISTRY.behaviours), len(REGISTRY.aggregators),\n"
    "            len(REGISTRY.message_kinds.kinds()), len(REGISTRY.summable_protocols()),\n"
    "            len(REGISTRY.secure_schemes), REGISTRY.partitioner is not None,\n"
    "            len(REGISTRY.eavesdroppers), REGISTRY.message_kinds is MESSAGE_KINDS]\n"
)


def run(code: str, env: dict | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", TABLES + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_importing_every_module_leaves_the_registries_empty_until_loaded():
    imports = "".join(f"import {m}\n" for m in (*BUILTIN, "examples.fedavgm", "examples.signflip"))
    out = run(
        imports + "print(sizes())\n"
        "import os\n"
        "os.environ['FOLTR_ASYNC_PLUGINS'] = 'examples.fedavgm,examples.signflip'\n"
        "from foltr_async.plugins import load_plugins\n"
        "load_plugins()\n"
        "print(sizes())\n"
        "print('fedavgm' in REGISTRY.protocols, 'sign_flip' in REGISTRY.behaviours,\n"
        "      'fedavgm.model' in REGISTRY.message_kinds, REGISTRY.summable_protocols())\n"
    )
    assert out[0] == "[0, 0, 0, 0, 0, 0, False, 0, True]"
    p, b, a, kinds, summable, schemes, part, eve, same = eval(out[1])  # noqa: S307 (our own output)
    assert (p, b, a, schemes, part, eve, same) == (8, 11, 5, 1, True, 2, True)
    assert kinds > 30 and summable == 2
    assert out[2] == "True True True ['fedavgm', 'fpdgd']"


def test_a_lookup_before_loading_is_one_line_naming_load_plugins():
    out = run(
        "from foltr_async.errors import FoltrError\n"
        "try:\n"
        "    REGISTRY.protocols['fpdgd']\n"
        "except FoltrError as e:\n"
        "    print(e)\n"
    )
    assert out == [
        "unknown protocol 'fpdgd': no protocols are registered (call load_plugins() first)"
    ]


def test_a_loaded_registry_names_the_nearest_protocol():
    with pytest.raises(FoltrError, match=r"unknown protocol 'fpgd' \(did you mean 'fpdgd'\?\)"):
        load_plugins().protocols["fpgd"]


def test_a_plugin_that_provides_nothing_is_one_line(monkeypatch):
    monkeypatch.setenv("FOLTR_ASYNC_PLUGINS", "tests.conftest")
    with pytest.raises(FoltrError) as e:
        load_plugins()
    assert str(e.value) == (
        "FOLTR_ASYNC_PLUGINS: module 'tests.conftest' declares nothing: expected a module-level "
        "PROVIDES tuple of what it adds (docs/EXTENDING.md)"
    )


def test_a_plugin_taking_a_built_in_name_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "clash.py").write_text(
        "from foltr_async.protocols import fpdgd\n"
        "from foltr_async.protocols.api import ProtocolEntry\n"
        "PROVIDES = (ProtocolEntry('fpdgd', 'another', fpdgd.Params, fpdgd.FPDGD),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FOLTR_ASYNC_PLUGINS", "clash")
    with pytest.raises(FoltrError, match=r"^FOLTR_ASYNC_PLUGINS: clash: ProtocolEntry 'fpdgd' "):
        load_plugins()


def test_list_shows_plugin_names_and_each_protocols_own_actions():
    done = subprocess.run(
        [sys.executable, "-m", "foltr_async", "list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "FOLTR_ASYNC_PLUGINS": "tests.plugin_retire, examples.fedavgm"},
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert lines["fpdgd_retire"].endswith("(timeline actions: retire, unlearn)")
    assert lines["fpdgd"].endswith("(timeline actions: unlearn)")
    assert "timeline actions" not in lines["fedavgm"] + lines["foltr_es"]
