"""The long-context planner: the cheapest options (offload, then tiles) that the memory model fits
on a GPU for a step of T tokens, the longest step some plan fits, and the fewest checkpointed layers a step needs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..ops._checks import check_real
from .memory import H200_USABLE_BYTES, GiB, MemoryModel, bytes_per_token, dims, memory_bytes
from .offload import HOST_RESERVE_BYTES, default_host_reserve, host_memory_available
from .tiles import check_tile_tokens


def plan_offload_layers(config, tokens: int, *, gpu_bytes: float = H200_USABLE_BYTES,
                        host_bytes: float | None = None, host_reserve_bytes: float = HOST_RESERVE_BYTES,
                        **model_settings) -> tuple[int, bool]:
    """The fewest decoder layers to offload for a step of ``tokens`` to fit ``gpu_bytes``, within the host memory.

    Args:
        config, tokens, gpu_bytes, host_bytes, **model_settings: as for ``plan_long_context``; an unknown host memory
            sets no limit here.
        host_reserve_bytes (float): of the host memory, what the offload leaves free. Default: ``HOST_RESERVE_BYTES``.

    Returns:
        tuple[int, bool]: the layers, and whether the step is predicted to fit.

    Raises:
        TypeError, ValueError, NotImplementedError: as ``plan_long_context``.
    """
    tokens = check_tile_tokens(tokens, "tokens", "the step's tokens")
    gpu_bytes = memory_bytes(gpu_bytes, "gpu_bytes")
    host_reserve_bytes = memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    room = math.inf if host_bytes is None else max(0.0, memory_bytes(host_bytes, "host_bytes") - host_reserve_bytes)
    layers = dims(config).L
    for k in range(layers + 1):
        model = bytes_per_token(config, offload=k, **model_settings)
        if tokens * model.host_per_token > room:
            return max(0, k - 1), False
        if model.peak(tokens) <= gpu_bytes:
            return k, True
    return layers, False


#: The candidate tile sizes of ``plan_long_context``, largest first: a larger tile is fewer,
#: longer launches; below 4096 tokens a tile's kernels are too short to keep the GPU busy.
PLAN_TILES = tuple(2**k for k in range(20, 11, -1))


@dataclass(frozen=True)
class LongContextPlan:
    """What ``plan_long_context`` chose for a step of ``tokens``; ``print`` it for a summary.

    Attributes:
        tiled_mlp, tiled_gdn (int or None): the tiles (None: untiled).
        offload_layers (int): the decoder layers whose checkpoint inputs go to host memory.
        fits (bool): whether the step is predicted to fit with these options.
        model (MemoryModel): the prediction for them (``model.peak(tokens)`` against ``gpu_bytes``).
        untiled_up_to (int): where the plan tiles, the longest step (a multiple of 1024 tokens)
            predicted to fit untiled with the plan's offload; else 0.
    """

    tokens: int
    tiled_mlp: int | None
    tiled_gdn: int | None
    offload_layers: int
    fits: bool
    model: MemoryModel
    gpu_bytes: float
    host_known: bool = True
    expandable_segments: bool = False  # the CUDA caching allocator's setting when the plan was made
    untiled_up_to: int = 0

    def options(self) -> dict:
        """The plan as ``apply_to_qwen3_5``'s long-context keyword arguments."""
        return {"tiled_mlp": self.tiled_mlp, "tiled_gdn": self.tiled_gdn, "offload_checkpoints": self.offload_layers}

    def __str__(self) -> str:
        chosen = [f"checkpoints of {self.offload_layers} of {self.model.layers} decoder layers in host memory"
                  if self.offload_layers else None,
                  f"the MLP in tiles of {self.tiled_mlp:,} tokens" if self.tiled_mlp else None,
                  f"the GatedDeltaNet in tiles of {self.tiled_gdn:,} tokens" if self.tiled_gdn else None,
                  f"tiles only in steps over {self.untiled_up_to:,} tokens" if self.untiled_up_to else None]
        nothing = "nothing (the step fits as it is)" if self.fits else "no option that helps"
        chosen = "; ".join(c for c in chosen if c) or nothing
        verdict = "fits" if self.fits else "does not fit even so"
        host = f"{self.tokens * self.model.host_per_token / GiB:.1f} GiB" if self.host_known else "none (unknown)"
        advice = ""
        if (self.offload_layers or self.tiled_mlp or self.tiled_gdn) and not self.expandable_segments:
            advice = ("; the allocator's fragmentation may end such a step below the prediction: set "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts")
        return (f"planned for {self.tokens:,} tokens: {chosen}; predicted peak "
                f"{self.model.peak(self.tokens) / GiB:.1f} of {self.gpu_bytes / GiB:.1f} GiB ({verdict}); "
                f"host memory for checkpoints: {host}{advice}")


def expandable_segments() -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns on expandable segments, which map freed blocks into one range
    instead of stranding them (fragmentation)."""
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "expandable_segments:true" in settings.split(",")


def plan_long_context(config, tokens: int, *, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                      host_reserve_bytes: float | None = None, **model_settings) -> LongContextPlan:
    """The cheapest long-context options under which a step of ``tokens`` is predicted (``bytes_per_token``) to fit
    ``gpu_bytes``: none; else the offload of the fewest layers that fit; else also the tiled MLP, then the tiled
    GatedDeltaNet, at the largest tile of ``PLAN_TILES`` below ``tokens`` that fits; else the most frugal plan, with
    ``fits=False``. It serves every shorter step too: a module tiles only a sequence longer than its tile, and
    ``apply_to_qwen3_5`` runs steps up to ``untiled_up_to`` untiled.

    Args:
        config: a dense Qwen3.5 text config (``Qwen3_5TextConfig``, or a config holding one).
        tokens (int): the longest step's tokens (one row).
        gpu_bytes (float): the GPU memory the step may use (``usable_gpu_bytes``). Default: ``H200_USABLE_BYTES``.
        host_bytes (float, optional): the host memory the offload may take. Default:
            ``host_memory_available()``; where that is unknown, the plan does not offload.
        host_reserve_bytes (float, optional): of ``host_bytes``, what the offload leaves free. Default:
            ``default_host_reserve()``.
        **model_settings: ``bytes_per_token``'s arguments (``lora_rank``, ``dtype_bytes``, ...).

    Returns:
        LongContextPlan: the options and the prediction; ``options()`` gives ``apply_to_qwen3_5``'s arguments.

    Raises:
        TypeError: ``config`` not a dense Qwen3.5 config, an argument not a number (``tokens`` not an int).
        ValueError: ``tokens`` below 1, a number of bytes negative or not finite.
        NotImplementedError: a MoE config.
    """
    tokens = check_tile_tokens(tokens, "tokens", "the longest step's tokens")
    gpu_bytes = memory_bytes(gpu_bytes, "gpu_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    host_known = host_bytes is not None
    host_bytes = 0.0 if host_bytes is None else memory_bytes(host_bytes, "host_bytes")
    if host_reserve_bytes is None:
        host_reserve_bytes = default_host_reserve()
    host_reserve_bytes = memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    tiles = [tile for tile in PLAN_TILES if tile < tokens]
    attempts = [{}] + [{"tiled_mlp_tokens": tile} for tile in tiles]
    if "linear_attention" in dims(config).layer_types:
        attempts += [{"tiled_mlp_tokens": tile, "tiled_gdn_tokens": tile} for tile in tiles]
    for settings in attempts:
        layers, fits = plan_offload_layers(config, tokens, gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                                           host_reserve_bytes=host_reserve_bytes, **settings, **model_settings)
        if fits:
            break
    model = bytes_per_token(config, offload=layers, **settings, **model_settings)
    untiled_up_to = 0
    if settings:  # the longest step that needs no tiles, by the same model and the same offload
        untiled = bytes_per_token(config, offload=layers, **model_settings)
        untiled_up_to = min(tokens - 1, untiled.longest_fit(gpu_bytes))
    return LongContextPlan(tokens=tokens, tiled_mlp=settings.get("tiled_mlp_tokens"),
                           tiled_gdn=settings.get("tiled_gdn_tokens"), offload_layers=layers, fits=fits, model=model,
                           gpu_bytes=gpu_bytes, host_known=host_known, expandable_segments=expandable_segments(),
                           untiled_up_to=untiled_up_to)


def longest_planned_step(config, *, gpu_bytes: float = H200_USABLE_BYTES, host_bytes: float | None = None,
                         host_reserve_bytes: float | None = None, multiple: int = 1024,
                         **model_settings) -> LongContextPlan:
    """The plan for the longest step, a multiple of ``multiple`` tokens, that ``plan_long_context`` predicts to fit.

    Found by doubling, then bisection (a step shorter than one that fits is taken to fit), against host memory read
    once, the same for every candidate.

    Args:
        config, gpu_bytes, host_bytes, host_reserve_bytes, **model_settings: as for ``plan_long_context``.
        multiple (int): the step's granularity in tokens. Default: 1024.

    Returns:
        LongContextPlan: that step's plan; where not even ``multiple`` tokens fit, theirs, with ``fits=False``.

    Raises:
        TypeError, ValueError, NotImplementedError: as ``plan_long_context``; also for ``multiple``.
    """
    multiple = check_tile_tokens(multiple, "multiple", "the step's granularity in tokens")
    gpu_bytes = memory_bytes(gpu_bytes, "gpu_bytes")
    if host_bytes is None:
        host_bytes = host_memory_available()
    if host_bytes is not None:
        host_bytes = memory_bytes(host_bytes, "host_bytes")
    if host_reserve_bytes is not None:
        host_reserve_bytes = memory_bytes(host_reserve_bytes, "host_reserve_bytes")
    dims(config)
    settings = dict(gpu_bytes=gpu_bytes, host_bytes=host_bytes, host_reserve_bytes=host_reserve_bytes, **model_settings)

    def plan(units: int) -> LongContextPlan:  # a step of `units` multiples
        return plan_long_context(config, units * multiple, **settings)

    lo = max(1, bytes_per_token(config, **model_settings).longest_fit(gpu_bytes, multiple=multiple) // multiple)
    if not plan(lo).fits:
        return plan(1)
    hi = 2 * lo
    while plan(hi).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # lo fits, hi does not
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if plan(middle).fits else (lo, middle)
    return plan(lo)


def usable_gpu_bytes(device: torch.device | str | None = None) -> float:
    """The memory a step on ``device`` may use, as ``plan_long_context`` counts it.

    Args:
        device (torch.device, str or int, optional): on a CUDA device, the memory free plus what this process's
            allocator holds (the weights, which the plan counts); elsewhere an H200's. Default: the CPU.

    Returns:
        float: the bytes.

    Raises:
        TypeError: ``device`` not a device, a string or an index.
        RuntimeError: an unknown device string (PyTorch's error).
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int, type(None))):
        raise TypeError(f"device: expected a torch.device, a string such as 'cuda' or None, got {device!r}")
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return float(H200_USABLE_BYTES)
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device))


#: Of a GPU's total memory, what ``checkpoint_budget`` leaves unplanned: the memory model's error, the allocator's
#: fragmentation, and what a longer-tailed step or another library takes beside it.
CHECKPOINT_MARGIN = 0.10


def checkpoint_budget(device: torch.device | str | None, margin: float = CHECKPOINT_MARGIN) -> float:
    """The bytes a step's predicted peak may reach on ``device`` when ``plan_checkpointing`` plans for it:
    ``free + reserved − margin · total`` (what the allocator can still get, less a margin of the card).

    Args:
        device (torch.device, str or int): a CUDA device.
        margin (float): the fraction of the total memory left unplanned, in [0, 1). Default: ``CHECKPOINT_MARGIN``.

    Returns:
        float: the bytes.

    Raises:
        TypeError: ``device`` not a device, ``margin`` not a number.
        ValueError: a device that is not a CUDA GPU (there is no memory to plan against: give ``memory_budget``),
            ``margin`` out of range.
    """
    margin = check_real("margin", margin, minimum=0.0, what="a fraction of the GPU's memory")
    if margin >= 1.0:
        raise ValueError(f"margin: expected a fraction of the GPU's memory in [0, 1), got {margin!r}")
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int, type(None))):
        raise TypeError(f"device: expected a torch.device, a string such as 'cuda' or None, got {device!r}")
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"memory_budget: the model is on {device.type!r}, which has no GPU memory to plan "
                         "checkpointing against; pass memory_budget= (the bytes a step's peak may reach)")
    free, total = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - margin * total)


def checkpoint_order(config, **model_settings) -> tuple[int, ...]:
    """The decoder layers in the order ``plan_checkpointing`` runs them without checkpointing: those that hold the
    fewest bytes a token first (``bytes_per_token``'s held activations), the later of two equal ones first (its
    activations are freed earliest in the backward)."""
    d = dims(config)
    held = {}
    for index in range(d.L):
        model = bytes_per_token(config, not_checkpointed=(index,), **model_settings)
        held[index] = model.per_token
    return tuple(sorted(range(d.L), key=lambda i: (held[i], -i)))


@dataclass(frozen=True)
class CheckpointPlan:
    """What ``plan_checkpointing`` chose for steps of up to ``tokens``; ``print`` it for a summary.

    Attributes:
        tokens (int): the step's tokens the plan is made for (a micro-batch's rows times their length).
        checkpointed (tuple): the decoder layers that keep gradient checkpointing.
        not_checkpointed (tuple): the decoder layers that run without it (their forward once a step).
        fits (bool): whether the step is predicted to fit ``budget`` (with every layer checkpointed where nothing
            fits: the fewest bytes the memory model knows).
        model (MemoryModel): the prediction for the plan (``model.peak(tokens)``).
        budget (float): the bytes the predicted peak may reach.
        budget_source (str): where ``budget`` came from.
    """

    tokens: int
    checkpointed: tuple
    not_checkpointed: tuple
    fits: bool
    model: MemoryModel
    budget: float
    budget_source: str = "given"

    @property
    def layers(self) -> int:
        return len(self.checkpointed) + len(self.not_checkpointed)

    @property
    def peak(self) -> float:
        return self.model.peak(self.tokens)

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "may not fit: every layer checkpointed is the least the plan can do"
        return (f"{len(self.checkpointed)} of {self.layers} decoder layers checkpointed for steps of up to "
                f"{self.tokens:,} tokens (longer steps checkpoint every layer); predicted peak "
                f"{self.peak / GiB:.1f} GiB of a budget of {self.budget / GiB:.1f} GiB ({self.budget_source}): "
                f"{verdict}")


def plan_checkpointing(config, tokens: int, *, memory_budget: float, budget_source: str = "given",
                       **model_settings) -> CheckpointPlan:
    """The fewest checkpointed decoder layers under which a step of ``tokens`` is predicted (``bytes_per_token``)
    to peak within ``memory_budget``: the layers leave checkpointing in ``checkpoint_order`` while the peak,
    ``fixed + T · per_token`` with each such layer holding its activations in place of its checkpoint input, fits.
    The peak grows with each layer taken out, so a larger budget never checkpoints more layers. Where not even
    every layer checkpointed fits, the plan checkpoints every layer, with ``fits=False``.

    Args:
        config: a dense Qwen3.5 text config (``Qwen3_5TextConfig``, or a config holding one).
        tokens (int): the step's tokens: a micro-batch's rows times their (padded) length.
        memory_budget (float): the bytes the predicted peak may reach (``checkpoint_budget`` for a GPU).
        budget_source (str): where the budget came from, for the summary. Default: "given".
        **model_settings: ``bytes_per_token``'s arguments (``lora_rank``, ``dtype_bytes``, ...), not the tiles,
            the offload or ``not_checkpointed``.

    Returns:
        CheckpointPlan: the layers and the prediction.

    Raises:
        TypeError: ``config`` not a dense Qwen3.5 config, an argument not a number (``tokens`` not an int).
        ValueError: ``tokens`` below 1, ``memory_budget`` negative or not finite, a long-context setting given.
        NotImplementedError: a MoE config.
    """
    tokens = check_tile_tokens(tokens, "tokens", "the step's tokens")
    memory_budget = memory_bytes(memory_budget, "memory_budget")
    refused = {"tiled_mlp_tokens", "tiled_gdn_tokens", "offload", "not_checkpointed"} & set(model_settings)
    if refused:
        raise ValueError(f"{', '.join(sorted(refused))}: plan_checkpointing plans untiled layers, none offloaded; "
                         "the long-context options need every layer checkpointed")
    order = checkpoint_order(config, **model_settings)
    chosen = bytes_per_token(config, **model_settings)
    fits = chosen.peak(tokens) <= memory_budget
    if fits:
        for n in range(1, len(order) + 1):
            model = bytes_per_token(config, not_checkpointed=order[:n], **model_settings)
            if model.peak(tokens) > memory_budget:
                break
            chosen = model
    plain = chosen.not_checkpointed
    return CheckpointPlan(tokens=tokens, checkpointed=tuple(i for i in range(chosen.layers) if i not in plain),
                          not_checkpointed=plain, fits=fits, model=chosen, budget=memory_budget,
                          budget_source=budget_source)
