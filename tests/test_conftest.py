"""The test suite itself: tests that need the shared real data skip on a fresh clone."""

import pytest
from conftest import shared_data


def test_missing_shared_data_skips_with_the_place_it_looked(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="real data not found at .*nowhere"):
        shared_data(tmp_path / "nowhere")


def test_present_shared_data_is_returned(tmp_path):
    (tmp_path / "train.txt").write_text("0 qid:1 1:0.5\n")
    assert shared_data(tmp_path) == tmp_path
