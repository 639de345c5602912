"""scripts/join_calls.py: one device call's rows joined to the rows of every earlier call."""

import importlib.util
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "join_calls.py"


def _join():
    spec = importlib.util.spec_from_file_location("join_calls", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.join


def test_a_call_keeps_the_other_calls_baselines_and_replaces_its_own_rows():
    kept = pd.DataFrame({"variant": ["q35lab", "q35lab+offload", "q35lab", "q35lab+tiled"],
                         "commit": ["aaa", "aaa", "bbb", "bbb"], "step_ms": [1.0, 2.0, 3.0, 4.0]})
    call = pd.DataFrame({"variant": ["q35lab", "q35lab+tiled"], "commit": ["bbb", "bbb"], "step_ms": [5.0, 6.0]})
    joined = _join()(call, kept)
    by_key = joined.set_index(["variant", "commit"]).step_ms
    assert len(joined) == 4 and by_key["q35lab", "aaa"] == 1.0 and by_key["q35lab+offload", "aaa"] == 2.0
    assert by_key["q35lab", "bbb"] == 5.0 and by_key["q35lab+tiled", "bbb"] == 6.0


def test_a_new_commit_adds_rows_beside_the_same_variants_of_older_calls():
    kept = pd.DataFrame({"variant": ["q35lab"], "commit": ["aaa"], "step_ms": [1.0]})
    call = pd.DataFrame({"variant": ["q35lab"], "commit": ["ccc"], "step_ms": [2.0]})
    joined = _join()(call, kept)
    assert list(zip(joined.variant, joined.commit)) == [("q35lab", "aaa"), ("q35lab", "ccc")]


def test_a_packed_and_a_padded_row_of_one_variant_and_call_both_stay():
    kept = pd.DataFrame({"variant": ["q35lab"], "batch": ["packed"], "commit": ["aaa"], "step_ms": [1.0]})
    call = pd.DataFrame({"variant": ["q35lab", "q35lab"], "batch": ["padded", "packed"], "commit": ["aaa", "aaa"],
                         "step_ms": [4.0, 2.0]})
    joined = _join()(call, kept).set_index(["batch"]).step_ms
    assert len(joined) == 2 and joined["padded"] == 4.0 and joined["packed"] == 2.0
