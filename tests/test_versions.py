"""q35lab.hf.versions: the supported transformers range, as pyproject.toml states it, and each
version-dependent fact as the installed transformers shows it (CI runs this on the lowest and the
newest release of the range)."""

import functools
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

from q35lab.hf import versions
from tiny_models import causal_lm

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _gdn(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))


def test_pyproject_requires_the_range_versions_names():
    requirements = re.findall(r'^\s*"(transformers[^"]*)"', PYPROJECT.read_text(), flags=re.MULTILINE)
    assert requirements == [versions.REQUIREMENT]
    bounds = re.fullmatch(r"transformers>=(\d+)\.(\d+),<(\d+)\.(\d+)", versions.REQUIREMENT)
    low_major, low_minor, below_major, below_minor = map(int, bounds.groups())
    assert (low_major, low_minor, 0) == versions.LOWEST
    assert (below_major, below_minor) == (versions.NEWEST_TESTED[0], versions.NEWEST_TESTED[1] + 1)


def test_the_installed_transformers_is_in_the_range():
    import transformers

    assert versions.installed() == versions.release(transformers.__version__)
    assert versions.supported(), f"transformers {transformers.__version__} is outside {versions.REQUIREMENT}"


@pytest.mark.parametrize("written, release", [("5.25.0", (5, 25, 0)), ("5.26.0.dev0", (5, 26, 0)), ("5.15", (5, 15, 0)),
                                              ("5.22.2", (5, 22, 2)), ("6.0.0rc1", (6, 0, 0))])
def test_a_release_is_read_from_its_version_string(written, release):
    assert versions.release(written) == release


def test_the_range_ends_before_the_next_minor_release():
    low, new = versions.LOWEST, versions.NEWEST_TESTED
    assert versions.supported(low) and versions.supported(new) and versions.supported((new[0], new[1], 9))
    assert not versions.supported((low[0], low[1] - 1, 9)) and not versions.supported((new[0], new[1] + 1, 0))
    with pytest.raises(ValueError, match="version: expected a release"):
        versions.release("main")


def test_the_gated_delta_net_calls_its_modeling_modules_functions():
    gdn = _gdn(causal_lm())
    modeling = versions.modeling_module(gdn)
    assert not {versions.CONV, "chunk_gated_delta_rule"} & set(vars(gdn))  # none kept on the layer (below 5.15)
    for name in (versions.CONV, versions.CHUNK_CORE, versions.RECURRENT_CORE):
        assert versions.module_function(modeling, name) is getattr(modeling, name) and callable(getattr(modeling, name))
    assert versions.module_function(modeling, "no_such_function") is None
    assert versions.module_function(modeling, "logger") is None  # there, but not a function


def _not_a_hub_wrapper(function) -> bool:
    return inspect.isfunction(function) and "implementation" not in inspect.getclosurevars(function).nonlocals


def test_the_hub_wrapper_is_seen_through_to_the_function_transformers_picked():
    modeling = versions.modeling_module(_gdn(causal_lm()))
    for name in (versions.CHUNK_CORE, versions.RECURRENT_CORE):
        picked = versions.hub_implementation(getattr(getattr(modeling, name), "original", getattr(modeling, name)))
        assert _not_a_hub_wrapper(picked), (name, picked)
        assert picked.__module__ == modeling.__name__ or picked.__module__.startswith("fla."), picked.__module__


def test_the_hub_wrapper_is_found_inside_a_kernels_function_module():
    """transformers 5.25 with `kernels` puts the wrapper in a module whose class's forward calls it."""
    def torch_core(*args):
        return "torch"

    def fla_core(*args):
        return "fla"

    def hub_wrapper(implementation):  # transformers' use_kernel_func_from_hub_with_fallback
        @functools.wraps(torch_core)
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)
        return wrapped

    def kernels_module(func):  # kernels' _create_func_module
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)
        return Func()

    for implementation in (torch_core, fla_core):
        assert versions.hub_implementation(hub_wrapper(implementation)) is implementation
        assert versions.hub_implementation(kernels_module(hub_wrapper(implementation))) is implementation
    assert versions.hub_implementation(fla_core) is fla_core and versions.hub_implementation(None) is None
    module = torch.nn.Linear(2, 2)  # a module that is not kernels': itself
    assert versions.hub_implementation(module) is module


def test_whether_the_forward_repeats_key_heads_is_as_the_release_says():
    cls = type(_gdn(causal_lm()))
    assert versions.forward_repeats_key_heads(cls) == (versions.installed() < (5, 23, 0))

    class WithoutSource(cls):  # a forward whose source cannot be read: repeat, which is exact for every core
        forward = functools.partial(cls.forward)

    assert versions.forward_repeats_key_heads(WithoutSource)


def test_where_checkpointing_enters_a_layer_is_as_the_release_says():
    assert versions.checkpoints_the_call() == (versions.installed() < (5, 23, 0))


def test_the_cache_reaches_a_gated_delta_net_and_its_layer_under_a_name_q35lab_knows():
    model = causal_lm()
    gdn = _gdn(model)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer") and _gdn(m) is not None)
    for module in (gdn, layer):  # (through a wrapper that is not functools.wraps', as 5.15's GatedDeltaNet has)
        parameters = {p for f in versions._wrapped_functions(type(module).forward)
                      for p in inspect.signature(f).parameters}
        assert parameters & set(versions.CACHE_ARGUMENTS), (type(module).__name__, parameters)


def test_checkpointing_is_enabled_without_a_deprecation_and_with_its_arguments():
    model = causal_lm()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpointing_enable.*deprecated", category=FutureWarning)
        versions.enable_checkpointing(model, use_reentrant=False)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers and all(m.gradient_checkpointing for m in layers)
    function = vars(layers[0])["_gradient_checkpointing_func"]
    assert function.keywords == {"use_reentrant": False}
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), device=model.device)
    model(input_ids=ids, labels=ids).loss.backward()  # runs through the checkpoint


def test_ci_installs_the_lowest_release_for_its_second_leg():
    import runpy

    # .ci/run reads the file alone (no torch, no q35lab): it must need nothing else
    alone = runpy.run_path(str(Path(versions.__file__)))
    assert alone["LOWEST_INSTALL"] == versions.LOWEST_INSTALL
    assert versions.LOWEST_INSTALL[0] == "transformers==" + ".".join(map(str, versions.LOWEST))
    assert "LOWEST_INSTALL" in (PYPROJECT.parent / ".ci" / "run").read_text()
