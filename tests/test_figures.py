"""Figures fit for a paper: vector and print-resolution files, one style per variant in every
panel, integer round axes from round 0, the scenario's question as title, the band named."""

import struct

import pytest

from foltr_async.observe import plots

pytest.importorskip("matplotlib")


def _results(privacy_for=("b", "c")) -> dict:
    """Three variants; a and b coincide until the last round; b and c report privacy."""
    curves = {
        "a": [0.3, 0.4, 0.5],
        "b": [0.3, 0.4, 0.45],
        "c": [0.2, 0.25, 0.3],
    }
    variants = {}
    for name, mean in curves.items():
        rep = {"rounds": [10, 20, 30], "offline": {"ndcg@10": mean}}
        if name in privacy_for:
            rep["privacy"] = {"curve": {"rounds": [10, 20, 30], "basic": [1.0, 2.0, 3.0]}}
        curve = {"rounds": [10, 20, 30], "mean": mean, "std": [0.01] * 3, "n": [2] * 3}
        variants[name] = {"repeats": [rep, rep], "summary": {"curve": curve}}
    return {
        "scenario": "slug_name",
        "seed": 4,
        "metric": "ndcg@10",
        "planned": {"variants": list(curves)},
        "config": {n: {"scenario": {"description": "Does b keep up with a?"}} for n in curves},
        "variants": variants,
    }


def test_every_figure_is_a_vector_pdf_and_a_300_dpi_png(tmp_path):
    png = plots.plot_curves(_results(), tmp_path / "curves.png")
    head = png.read_bytes()
    assert head[:4] == b"\x89PNG"
    width, height = struct.unpack(">II", head[16:24])
    assert height >= 4.5 * 300  # inches x dots per inch
    assert (tmp_path / "curves.pdf").read_bytes()[:5] == b"%PDF-"


def _drawn(results: dict, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    orig = Figure.savefig

    def keep(self, *a, **k):
        figures.append(self)
        return orig(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(plots, "DPI", 40, raising=False)  # the drawing, not its resolution
    plots.plot_curves(results, tmp_path / "curves.png")
    return figures[-1]


def _styles(ax) -> dict[str, tuple]:
    return {
        line.get_label().split(" (")[0]: (line.get_color(), line.get_linestyle(), line.get_marker())
        for line in ax.lines
        if not line.get_label().startswith("_")
    }


def test_a_variant_keeps_its_colour_and_marker_in_every_panel(tmp_path, monkeypatch):
    """The privacy panel has no curve of variant a: b and c keep their colours there."""
    fig = _drawn(_results(), tmp_path, monkeypatch)
    main, privacy = fig.axes[:2]
    mine, theirs = _styles(main), _styles(privacy)
    assert set(theirs) == {"b", "c"}
    for name in theirs:
        assert theirs[name][0] == mine[name][0] and theirs[name][2] == mine[name][2]
    assert len(set(mine.values())) == 3  # colour, line style and marker: three looks


def test_coinciding_curves_differ_in_line_style_and_marker(tmp_path, monkeypatch):
    fig = _drawn(_results(), tmp_path, monkeypatch)
    a, b = (_styles(fig.axes[0])[n] for n in ("a", "b"))
    assert a[1] != b[1] and a[2] != b[2]


def test_round_axes_are_whole_rounds_from_round_0(tmp_path, monkeypatch):
    fig = _drawn(_results(), tmp_path, monkeypatch)
    for ax in fig.axes[:2]:
        assert ax.get_xlim()[0] == 0
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)


def test_title_is_the_scenarios_question_and_the_band_is_named(tmp_path, monkeypatch):
    fig = _drawn(_results(), tmp_path, monkeypatch)
    assert fig._suptitle.get_text() == "Does b keep up with a?"
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "± 1 sample standard deviation over the repeats" in caption
    assert "slug_name, seed 4" in caption
    res = {**_results(), "complete": False}
    res.pop("config")
    fig = _drawn(res, tmp_path, monkeypatch)
    assert fig._suptitle.get_text() == "slug_name (partial)"  # no question: the name


def test_summary_opens_with_the_scenarios_question():
    from foltr_async.observe.results import render_summary_md

    md = render_summary_md({**_results(), "seed": 4}).splitlines()
    assert md[:3] == ["# slug_name", "", "Does b keep up with a?"]
