"""Every op with a launch configuration chooses it one way: ``launch_config(shape)`` is this GPU's
``ops/tuned.json`` entry over the heuristic default's other fields, else the default; the host
functions take ``config=``; no op keeps a module-global override."""

import importlib

import pytest

from q35lab.ops import _tuned

#: (module, launch_config's arguments, the tuned.json key they look up, a field and a value to tune)
OPS = [
    ("swiglu", (12288,), 12288, "bwd_warps", 2),
    ("routed_experts", (2048,), 2048, "block_rows", 2),
    ("causal_conv1d", (8192, 4), "8192x4", "bwd_block_t", 16),
    ("contiguous_rows", (8192,), 8192, "block_rows", 2),
    ("offset_rms_norm", (4096,), 4096, "bwd_stages", 2),
    ("gated_rms_norm", (128,), 128, "bwd_warps", 8),
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
