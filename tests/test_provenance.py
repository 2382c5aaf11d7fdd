"""The code stamp names the code that ran: the same in a checkout and in an installed wheel's
layout, another when any file of the simulator or its protocols changes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from foltr_async.provenance import code_stamp

ROOT = Path(__file__).resolve().parent.parent
STAMP = "import json, foltr_async.provenance as p; print(json.dumps(p.code_stamp()))"


def _stamp(where: Path) -> dict:
    """The stamp a fresh interpreter computes with ``where`` first on its path."""
    out = subprocess.run(
        [sys.executable, "-c", STAMP], cwd=where, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))


def test_the_stamp_is_the_same_in_a_wheel_and_changes_with_the_code(tmp_path):
    checkout, wheel = tmp_path / "checkout", tmp_path / "wheel"
    _copy(ROOT / "foltr_async", checkout / "foltr_async")
    _copy(ROOT / "protocols", checkout / "protocols")
    (checkout / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    _copy(ROOT / "foltr_async", wheel / "foltr_async")  # protocols inside the package
    _copy(ROOT / "protocols", wheel / "foltr_async" / "protocols")
    mine = code_stamp()["source"]
    assert _stamp(checkout)["source"] == mine
    assert "commit" not in _stamp(checkout)  # not a git checkout
    assert _stamp(wheel)["source"] == mine and "commit" not in _stamp(wheel)  # this copy ran
    fpdgd = checkout / "protocols" / "fpdgd.py"
    fpdgd.write_text(fpdgd.read_text() + "\n# one more line\n")
    assert _stamp(checkout)["source"] != mine
