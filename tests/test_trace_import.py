"""FedScale's published pickles: the data-only unpickler, the seeded client draw, the CLI."""

import json
import os
import pickle
from collections import Counter

import pytest

from foltr_async.cli import main
from foltr_async.errors import FoltrError
from foltr_async.runtime.trace_import import import_fedscale, read_plain_pickle
from foltr_async.runtime.traces import load_trace

DEVICE = {k: {"computation": 10.0 * k, "communication": 800.0 * k} for k in range(1, 6)}
BEHAVIOUR = {
    100 + i: {
        "active": [0, 40 + i],
        "inactive": [10, 60],
        "finish_time": 100,
        "duration": 30,
        "model": "SM-G9600",
    }
    for i in range(3)
}


def dump(tmp_path, name, obj):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj))
    return p


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_calls_anything_is_refused_in_one_line_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    evil = dump(tmp_path, "client_device_capacity", {1: RunsACommand(marker)})
    behaviour = dump(tmp_path, "client_behave_trace", BEHAVIOUR)
    with pytest.raises(FoltrError) as err:
        read_plain_pickle(evil)
    text = str(err.value)
    assert "refused" in text and "system" in text and "\n" not in text
    assert not marker.exists()
    out = tmp_path / "t.json"
    assert main(["traces", "import", "fedscale", str(evil), str(behaviour), "--out", str(out)]) == 2
    assert not marker.exists() and not out.exists()
    # a class (here a numpy-style scalar) is as refused as a call
    with pytest.raises(FoltrError, match="refused: the pickle calls collections.OrderedDict"):
        read_plain_pickle(dump(tmp_path, "od", __import__("collections").OrderedDict(a=1)))


def test_plain_pickles_import_into_paired_clients_drawn_by_the_seed(tmp_path):
    dev, beh = dump(tmp_path, "dev", DEVICE), dump(tmp_path, "beh", BEHAVIOUR)
    out = tmp_path / "t.json"
    facts = import_fedscale(dev, beh, out, clients=12, seed=5)
    doc = json.loads(out.read_text())
    assert facts["clients"] == 12 and list(doc["device"]) == [str(j) for j in range(12)]
    assert list(doc["behaviour"]) == list(doc["device"])  # one id per client: paired by id
    dev_ids = [e["trace_id"] for e in doc["device"].values()]
    beh_ids = [e["trace_id"] for e in doc["behaviour"].values()]
    # every row used as evenly as possible: 12 = 2 x 5 + 2 device rows, 4 x 3 behaviour rows
    assert sorted(Counter(dev_ids).values()) == [2, 2, 2, 3, 3]
    assert Counter(beh_ids) == {100: 4, 101: 4, 102: 4}
    assert sorted(dev_ids[:5]) == [1, 2, 3, 4, 5]  # the first five: one permutation
    # the entries keep FedScale's numbers and drop its other fields
    assert all(
        e == {**DEVICE[e["trace_id"]], "trace_id": e["trace_id"]} for e in doc["device"].values()
    )
    first = doc["behaviour"]["0"]
    assert set(first) == {"active", "inactive", "finish_time", "trace_id"}
    # the file is a trace the simulator reads, client j = device j with behaviour j
    trace = load_trace(str(out))
    assert len(trace.clients) == 12
    j = beh_ids.index(102)
    assert trace.of(f"client-{j:04d}").intervals == ((0.0, 10.0), (42.0, 60.0))
    assert trace.of(f"client-{j:04d}").bandwidth == DEVICE[dev_ids[j]]["communication"] * 125
    # reproducible from the seed, another seed pairs other rows
    again = tmp_path / "again.json"
    import_fedscale(dev, beh, again, clients=12, seed=5)
    assert again.read_text() == out.read_text()
    other = tmp_path / "other.json"
    import_fedscale(dev, beh, other, clients=12, seed=6)
    assert json.loads(other.read_text())["device"] != doc["device"]


def test_the_cli_writes_the_trace_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    dev, beh = dump(tmp_path, "dev", DEVICE), dump(tmp_path, "beh", BEHAVIOUR)
    out = tmp_path / "t.json"
    args = ["traces", "import", "fedscale", str(dev), str(beh), "--out", str(out)]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "3 clients (seed 0)" in said and "behaviour rows 3 of 3" in said
    assert main(args) == 2  # never replaces a file
    assert "exists; nothing was replaced" in capsys.readouterr().err
    bad = {1: {"computation": float("nan"), "communication": 5.0}}
    cases = {
        "nan.pkl": (bad, "client 1: computation: expected a number > 0"),
        "list.pkl": ([1, 2], "expected FedScale's client_device_capacity: a dict"),
        "text.pkl": (b"", "not a readable pickle"),
    }
    for name, (obj, message) in cases.items():
        p = tmp_path / name
        p.write_bytes(obj if isinstance(obj, bytes) else pickle.dumps(obj))
        target = tmp_path / f"{name}.json"
        assert main(["traces", "import", "fedscale", str(p), str(beh), "--out", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {p}:") and message in err and "\n" not in err
    uneven = {7: {"active": [1, 2], "inactive": [3], "finish_time": 10}}
    p = dump(tmp_path, "uneven", uneven)
    assert (
        main(["traces", "import", "fedscale", str(dev), str(p), "--out", str(tmp_path / "u")]) == 2
    )
    assert "client 7: expected active and inactive lists of one length" in capsys.readouterr().err


def test_a_raw_pickle_as_network_trace_names_the_import_command(tmp_path):
    from foltr_async.errors import ScenarioError
    from foltr_async.scenario.load import load_scenario

    raw = dump(tmp_path, "client_behave_trace", BEHAVIOUR)
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[federation]\nprotocol = "fpdgd"\n[network]\ntrace = "{raw}"\n')
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario)
    text = str(err.value)
    assert "python -m foltr_async traces import fedscale" in text and "\n" not in text
