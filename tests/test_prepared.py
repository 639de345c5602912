"""Weight-only preparations shared by a tiled call's tiles (q35lab.ops._prepared)."""

import contextlib
import copy

import pytest
import torch
from conftest import patch_everywhere
from test_long_context import GDN_TARGETS, MLP_TARGETS, _model, _step

import q35lab
from q35lab.ops import _prepared, fused_projections
from q35lab.runtime import device


def test_outside_a_block_every_call_builds_inside_one_the_same_key_builds_once():
    calls = []
    weight = torch.randn(3, 4)

    def get(value, *key):
        return _prepared.prepared(lambda: (calls.append(value), torch.full((2,), float(value)))[1], "name", *key)

    first, second = get(1, weight, torch.float32), get(2, weight, torch.float32)
    assert calls == [1, 2] and not torch.equal(first, second)  # no block: nothing shared
    calls.clear()
    with _prepared.shared_preparations():
        a = get(1, weight, torch.float32)
        assert get(2, weight, torch.float32) is a  # the same name and key: the first one's
        assert get(3, weight, torch.bfloat16) is not a  # another plain value
        assert get(4, weight.clone(), torch.float32) is not a  # another tensor, equal values
        with _prepared.shared_preparations():  # nested: the outer block's
            assert get(5, weight, torch.float32) is a
        weight.add_(1.0)  # changed in place: its version moved, prepared again
        b = get(6, weight, torch.float32)
        assert b is not a and get(7, weight, torch.float32) is b
    assert calls == [1, 3, 4, 6]
    get(8, weight, torch.float32)  # the block is over
    assert calls[-1] == 8


@pytest.mark.parametrize("targets", [GDN_TARGETS + MLP_TARGETS, "all-linear"])
def test_a_tiled_step_prepares_each_weight_once_a_pass_and_gives_the_step_it_gave_unshared(monkeypatch, targets):
    ids = torch.randint(0, 128, (1, 17), device=device())
    reference = _model(targets=targets)
    steps, builds = {}, {}
    for way in ("untiled", "tiled", "tiled, unshared"):
        model = copy.deepcopy(reference)
        q35lab.apply_to_qwen3_5(model, **({} if way == "untiled" else {"tiled_gdn": 4, "tiled_mlp": 4}))
        blocks = []
        real_block = fused_projections._block_diagonal_b

        def counted(*args, **kwargs):  # called only by this iteration's step
            blocks.append(1)  # noqa: B023
            return real_block(*args, **kwargs)  # noqa: B023

        monkeypatch.setattr(fused_projections, "_block_diagonal_b", counted)
        if way == "tiled, unshared":
            patch_everywhere(monkeypatch, "shared_preparations", contextlib.nullcontext)
        steps[way] = _step(model, ids)
        builds[way] = len(blocks)
        monkeypatch.undo()
    # 5 tiles a layer: built once in the forward and once in the backward, as the untiled layer builds it in its
    # forward and its checkpoint's recompute; unshared, once a tile in each
    assert builds["untiled"] > 0 and builds["tiled"] == builds["untiled"]
    assert builds["tiled, unshared"] > builds["tiled"]
    (loss, grads), (loss_unshared, grads_unshared) = steps["tiled"], steps["tiled, unshared"]
    assert torch.equal(loss, loss_unshared) and grads.keys() == grads_unshared.keys()
    for name in grads:  # the same casts, computed once instead of once a tile: the same values
        assert torch.equal(grads[name], grads_unshared[name]), name
