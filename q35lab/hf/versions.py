"""The transformers releases q35lab supports, and each private fact about them that differs between releases.

Each fact is one function or constant here, so a new release is checked in one place. Facts are read from
the code that runs (a source, a closure, a class's attributes), not the version number, so a development
build is judged by what it does.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types

#: The lowest release supported: from 5.15 the GatedDeltaNet calls its modeling module's conv and delta
#: rule, which q35lab switches to keep packed sequences apart (5.2 to 5.14 never pass their boundaries).
LOWEST = (5, 15, 0)
#: The newest release tested; the range ends before the next minor release.
NEWEST_TESTED = (5, 25, 0)
#: The requirement in pyproject.toml (a test checks that the two agree).
REQUIREMENT = f"transformers>={LOWEST[0]}.{LOWEST[1]},<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}"
#: What CI installs to test the lowest release (.ci/run reads it without importing q35lab).
LOWEST_INSTALL = ("transformers==" + ".".join(map(str, LOWEST)), "tokenizers>=0.22,<=0.23.0", "huggingface_hub>=1.5,<2")


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string: "5.25.0", "5.26.0.dev0" or "5.15" (patch 0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"version: expected a release such as '5.25.0', got {version!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def installed() -> tuple[int, int, int]:
    """The installed transformers' release."""
    import transformers

    return release(transformers.__version__)


def supported(version: tuple[int, int, int] | None = None) -> bool:
    """Whether ``version`` (default: the installed one) is in the supported range."""
    version = installed() if version is None else version
    return LOWEST <= version < (NEWEST_TESTED[0], NEWEST_TESTED[1] + 1)


# ---- Where a GatedDeltaNet's causal conv and delta rule live ----------------------------------

#: The modeling module's functions a GatedDeltaNet calls (5.15 on): the causal conv, and the chunked
#: and recurrent delta rules (fla's where transformers could import it, else its own PyTorch ones).
CONV = "causal_conv1d_fn"
CHUNK_CORE = "torch_chunk_gated_delta_rule"
RECURRENT_CORE = "torch_recurrent_gated_delta_rule"


def modeling_module(module) -> types.ModuleType:
    """The modeling module that defines ``module``'s class (where its functions are looked up)."""
    return sys.modules[type(module).__module__]


def module_function(modeling: types.ModuleType, name: str):
    """``modeling``'s function ``name`` (``CONV``, ``CHUNK_CORE``, ``RECURRENT_CORE``), None where it
    has none that can be called."""
    function = getattr(modeling, name, None)
    return function if callable(function) else None


def hub_implementation(function):
    """The implementation transformers' hub wrapper picked at import for ``function``: the wrapper's
    closure variable ``implementation`` (5.15 on), reached through a ``kernels`` module's ``func``
    (5.25 on, with ``kernels``); anything else is its own implementation."""
    if not inspect.isfunction(function):  # a `kernels` module: its class's forward holds the wrapper
        function = _closure(getattr(type(function), "forward", None)).get("func", function)
    return _closure(function).get("implementation", function)


def _closure(function) -> dict:
    return inspect.getclosurevars(function).nonlocals if inspect.isfunction(function) else {}


def hub_calls_pytorch_core() -> bool:
    """Whether transformers' hub wrapper, called now, runs its PyTorch function rather than the package's:
    under ``torch.export``, which it reads from ``is_torchdynamo_exporting()``. With torch < 2.13 dynamo
    answers True there under ``torch.compile`` too, so a compiled GatedDeltaNet runs the PyTorch core."""
    from transformers.utils import import_utils

    exporting = getattr(import_utils, "is_torchdynamo_exporting", None)
    return bool(exporting is not None and exporting())


# ---- The GatedDeltaNet's forward --------------------------------------------------------------

@functools.cache
def forward_repeats_key_heads(cls: type) -> bool:
    """Whether ``cls.forward`` repeats q and k to the value heads itself (transformers < 5.23).

    Read from the source of the forward and what its wrappers call; True where no source is found
    (repeating is exact for every core)."""
    sources = []
    for function in _wrapped_functions(cls.forward):
        try:
            sources.append(inspect.getsource(function))
        except (OSError, TypeError):
            pass
    return not sources or any("repeat_interleave" in source for source in sources)


def _wrapped_functions(function, depth: int = 3) -> list:
    """``function`` unwrapped, and the functions it closes over (what a wrapper calls), ``depth`` deep."""
    function = inspect.unwrap(function)
    found = [function]
    for value in _closure(function).values() if depth else ():
        if inspect.isfunction(value):
            found += _wrapped_functions(value, depth - 1)
    return found


#: Keywords that carry a cache: ``cache_params``/``past_key_values`` below 5.24, ``cache`` from 5.24.
CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")


# ---- Gradient checkpointing -------------------------------------------------------------------

def checkpoints_the_call() -> bool:
    """Whether ``GradientCheckpointingLayer`` checkpoints ``__call__`` (transformers < 5.23), around an
    instance's forward, rather than the class's ``forward`` (5.23 on)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in vars(GradientCheckpointingLayer)


def enable_checkpointing(model, **checkpoint_kwargs) -> None:
    """Turn on the model's activation checkpointing with ``checkpoint_kwargs`` for ``torch.utils.checkpoint``
    (``activation_checkpointing_enable`` from 5.23, ``gradient_checkpointing_enable`` below)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def disable_checkpointing(model) -> None:
    """Turn the model's activation checkpointing off (``activation_checkpointing_disable`` from 5.23,
    ``gradient_checkpointing_disable`` below)."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
