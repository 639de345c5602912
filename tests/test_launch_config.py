"""Every op with a launch configuration chooses it one way: ``launch_config(shape)`` is this GPU's
``ops/tuned.json`` entry over the heuristic default's other fields, else the default; the host
functions take ``config=``; no op keeps a module-global override."""

import dataclasses
import importlib
import json
import random
import re
from pathlib import Path

import pytest

from q35lab.ops import _tuned


@dataclasses.dataclass(frozen=True)
class Config:
    """A LaunchConfig of two fields, for the tables' tests."""

    a: int = 0
    b: int = 0


#: (module, launch_config's arguments, the tuned.json key they look up, a field and a value to tune)
OPS = [
    ("swiglu", (12288,), 12288, "bwd_warps", 2),
    ("routed_experts", (2048,), 2048, "block_rows", 2),
    ("causal_conv1d", (8192, 4), "8192x4", "bwd_block_t", 16),
    ("contiguous_rows", (8192,), 8192, "block_rows", 2),
    ("offset_rms_norm", (4096,), 4096, "bwd_stages", 2),
    ("gated_rms_norm", (128,), 128, "bwd_warps", 1),
]


@pytest.mark.parametrize("name, args, key, field, value", OPS, ids=[op[0] for op in OPS])
def test_launch_config_is_the_tuned_entry_over_the_default(monkeypatch, name, args, key, field, value):
    op = importlib.import_module(f"q35lab.ops.{name}")
    assert not hasattr(op, "CONFIG_OVERRIDE")
    op.launch_config.cache_clear()
    default = op.launch_config(*args)
    assert getattr(default, field) != value  # the tuned value must be visible
    monkeypatch.setattr(_tuned, "tuned_fields", lambda op_name, shape: {field: value}
                        if (op_name, shape) == (name, key) else None)
    op.launch_config.cache_clear()
    try:
        tuned = op.launch_config(*args)
        assert getattr(tuned, field) == value
        assert tuned == default.__class__(**{**default.__dict__, field: value})  # the other fields: the default's
    finally:
        op.launch_config.cache_clear()


def test_a_misspelt_tuned_field_is_an_error_naming_it(monkeypatch):
    from q35lab.ops import causal_conv1d as op

    monkeypatch.setattr(_tuned, "tuned_fields", lambda op_name, shape: {"bwd_blok_t": 16})
    op.launch_config.cache_clear()
    try:
        with pytest.raises(ValueError, match="bwd_blok_t"):
            op.launch_config(8192, 4)
    finally:
        op.launch_config.cache_clear()


# Where the tuned entries come from: the shipped ops/tuned.json, and the user's file over it
def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))


def test_the_users_entry_overrides_the_shipped_one_at_its_gpu_op_and_key(tuned_tables):
    shipped, user, gpu = tuned_tables
    a, b, c, d = random.sample(range(1, 1000), 4)
    table = json.loads(shipped.read_text())
    others = dict(table)  # the shipped GPUs, which the user file does not name
    table[gpu] = {"some_op": {"96": {"a": a, "b": b}, "128": {"a": c}}}
    _write(shipped, table)
    _write(user, {gpu: {"some_op": {"96": {"a": d}}, "another_op": {"7": {"b": b}}}})

    assert _tuned.tuned_fields("some_op", 96) == {"a": d}  # the whole entry is the user's: no shipped "b"
    assert _tuned.tuned_fields("some_op", 128) == {"a": c}  # the shipped entry where the user has none
    assert _tuned.tuned_fields("another_op", 7) == {"b": b}
    assert _tuned.tuned_config("some_op", 96, Config()) == Config(a=d)
    assert {g: ops for g, ops in _tuned._table().items() if g != gpu} == others


def test_the_user_file_is_the_env_var_else_the_xdg_cache_else_the_home_cache(monkeypatch, tmp_path):
    named, xdg, home = tmp_path / f"mine{random.randrange(10**6)}.json", tmp_path / "xdg", tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setenv("Q35LAB_TUNED_FILE", str(named))
    assert _tuned.user_file() == named
    monkeypatch.setenv("Q35LAB_TUNED_FILE", "")  # empty: unset
    assert _tuned.user_file() == xdg / "q35lab" / "tuned.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec ignores a relative path
    assert _tuned.user_file() == home / ".cache" / "q35lab" / "tuned.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("Q35LAB_TUNED_FILE")
    assert _tuned.user_file() == home / ".cache" / "q35lab" / "tuned.json"


def test_save_writes_the_user_file_and_never_the_package_one(tuned_tables):
    shipped, user, gpu = tuned_tables
    real = Path(_tuned.__file__).with_name("tuned.json")
    package, before = shipped.read_bytes(), real.read_bytes()
    first, second = ({"a": random.randrange(1000)} for _ in range(2))
    assert _tuned.tuned_fields("some_op", 96) is None
    assert _tuned.save("some_op", 96, first, gpu) == user  # its folder made
    assert _tuned.save("some_op", "8x4", second, gpu) == user  # beside the first
    assert json.loads(user.read_text()) == {gpu: {"some_op": {"96": first, "8x4": second}}}
    assert _tuned.tuned_fields("some_op", 96) == first  # read again at once
    assert shipped.read_bytes() == package  # the (copied) package file untouched
    assert real.read_bytes() == before  # and the real one


def test_save_shipped_writes_the_package_file_only(tuned_tables):
    shipped, user, gpu = tuned_tables
    fields = {"a": random.randrange(1000)}
    assert _tuned.save("some_op", 96, fields, gpu, shipped=True) == shipped
    assert json.loads(shipped.read_text())[gpu] == {"some_op": {"96": fields}}
    assert not user.exists()


@pytest.mark.parametrize("text, says", [('{"gpu": {"op": ', "could not read it"),
                                        ('["not", "a", "table"]', "expected JSON objects"),
                                        ('{"gpu": {"op": {"96": 3}}}', "expected JSON objects"),
                                        (b"\xff\xfe", "could not read it")])
def test_a_corrupt_user_file_is_an_error_naming_it(tuned_tables, text, says):
    _, user, gpu = tuned_tables
    user.parent.mkdir()
    user.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"^{re.escape(str(user))}: .*{says}.*fix or delete it"):
        _tuned.tuned_fields("some_op", 96)
    with pytest.raises(ValueError, match=re.escape(str(user))):  # nor is it written over
        _tuned.save("some_op", 96, {"a": 1}, gpu)
    assert user.read_bytes() == (text if isinstance(text, bytes) else text.encode())


def test_the_tests_never_read_this_machines_own_tuning():
    from q35lab.ops import _tuned

    user = _tuned.user_file()
    assert user.parent.name.startswith("q35lab-tests-") and not user.exists()
    assert user.parent != Path.home() / ".cache" / "q35lab"
