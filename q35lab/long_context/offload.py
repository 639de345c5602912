"""Decoder-layer checkpoints offloaded to pinned host memory: each checkpointed layer's input [B, T, H] is copied
to the host on a side stream in the forward and brought back, the next one prefetched, in the backward."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter

import torch

from ..hf import versions
from ..hf.modules import layer_stacks, remove_stack_pre_hooks, stack_layers, stack_pre_hooks
from ..ops._checks import check_bool, check_int, check_module
from .memory import GiB, layer_count, memory_bytes
from .tiles import TiledForward

#: Saved tensors smaller than this stay where they are (a bf16 [1, T, 4096] checkpoint passes it from T = 128).
MIN_OFFLOAD_BYTES = 2**20

#: Host memory the offload leaves to the process, the data loader and the OS: pinned memory is never swapped out,
#: and a host that runs out ends the process without an error. Below 64 GiB, a quarter (``default_host_reserve``).
HOST_RESERVE_BYTES = 16 * 2**30

#: The most bytes of one pinned host block: PyTorch's ``CachingHostAllocator`` rounds each request up to a power of
#: two, so one block per [T, H] tensor could waste half the host memory; blocks waste one block's rounding a tensor.
HOST_CHUNK_BYTES = 64 * 2**20


class _Kept:
    """A saved tensor left on its device, chained so that its unpacking prefetches the one saved before it."""

    __slots__ = ("tensor", "prev", "__weakref__")

    def __init__(self, tensor, prev):
        self.tensor, self.prev = tensor, prev


class _HostCopy:
    """A saved tensor's host copy (pinned blocks for a CUDA tensor), its D2H event and a prefetched copy."""

    __slots__ = ("chunks", "shape", "dtype", "device", "d2h", "prev", "fetched", "h2d", "__weakref__")

    def __init__(self, chunks, shape, dtype, device, d2h, prev):
        self.chunks, self.shape, self.dtype, self.device, self.d2h, self.prev = chunks, shape, dtype, device, d2h, prev
        self.fetched, self.h2d = None, None

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)


def _parameter_storages(model: torch.nn.Module) -> set[int]:
    """Data pointers of ``model``'s parameter storages. An FSDP2 DTensor has none of its own: its local shard's is
    taken (the gathered weight FSDP2 hands the forward is an ``nn.Parameter``, which ``_wanted`` refuses by type);
    a storage FSDP2 has freed (pointer 0) is skipped."""
    pointers = set()
    with torch.no_grad():  # to_local of a DTensor that requires grad would record an autograd node
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            pointer = local.untyped_storage().data_ptr()
            if pointer:
                pointers.add(pointer)
    return pointers


class CheckpointOffloader:
    """Saved-tensor hooks that keep large saved tensors in host memory between forward and backward.

    Around a decoder layer's checkpoint call (``offload_decoder_layers``) they pack only its input ``[B, T, H]`` (what
    the layer saves inside, the checkpoint recomputes); around a whole forward (``offloaded_checkpoints``), every
    tensor saved outside a checkpoint. A tensor of at least ``min_bytes`` that neither is nor shares memory with a
    parameter is copied into pinned host blocks on a side CUDA stream (plain host tensors on a CPU) and comes back,
    contiguous, on that stream in backward, the one saved before it prefetched. ``stats`` counts packed, offloaded (and
    their bytes), kept, unpacked and prefetched tensors.

    Args:
        min_bytes (int): smaller tensors stay where they are. Default: ``MIN_OFFLOAD_BYTES``.
        layers (int, optional): offload in the first this many decoder layers only. Default: None (every layer).
        prefetch (bool): bring back the tensor saved before the one being unpacked. Default: True.
        pin_memory (bool, optional): pinned host blocks for a CUDA tensor. Default: None (pinned).
        chunk_bytes (int): the most bytes of one host block. Default: ``HOST_CHUNK_BYTES``.
        host_reserve_bytes (int, optional): host memory an offload leaves free; a copy that would take it raises
            ``MemoryError``. Default: ``default_host_reserve()``.

    Raises:
        TypeError: an argument not of the type above.
        ValueError: ``min_bytes``, ``layers`` or ``host_reserve_bytes`` below 0, ``chunk_bytes`` below 1.
    """

    def __init__(self, *, min_bytes: int = MIN_OFFLOAD_BYTES, layers: int | None = None, prefetch: bool = True,
                 pin_memory: bool | None = None, chunk_bytes: int = HOST_CHUNK_BYTES,
                 host_reserve_bytes: int | None = None):
        self.min_bytes = check_int("min_bytes", min_bytes, minimum=0, what="bytes")
        if host_reserve_bytes is None:
            host_reserve_bytes = default_host_reserve()
        self.host_reserve_bytes = check_int("host_reserve_bytes", host_reserve_bytes, minimum=0, what="bytes")
        self.chunk_bytes = check_int("chunk_bytes", chunk_bytes, minimum=1, what="bytes")
        self.layers = None if layers is None else check_int("layers", layers, minimum=0, what="decoder layers")
        self.prefetch = check_bool("prefetch", prefetch)
        self.pin_memory = None if pin_memory is None else check_bool("pin_memory", pin_memory)
        self._reset()

    def _reset(self) -> None:
        self.stats = Counter()
        self._last = None  # weak reference to the handle packed last in this chain
        self._chain_bytes = 0  # host bytes this chain has offloaded so far
        self._most_bytes = 0  # the most any chain held: pinned blocks PyTorch's host allocator keeps for reuse
        self._streams: dict = {}
        self._offloading = True
        self._model = None  # weak reference to the model whose parameters are never offloaded
        self._parameter_storages: set = set()

    def exclude_parameters_of(self, model: torch.nn.Module) -> None:
        """Never offload a tensor sharing memory with ``model``'s parameters (packed weights, a weight saved by a
        GEMM); read again at each new chain."""
        self._model = weakref.ref(model)
        self.new_chain()

    def __getstate__(self) -> dict:  # a copy keeps the settings, not the streams or this step's chain
        return {k: getattr(self, k) for k in ("min_bytes", "layers", "prefetch", "pin_memory", "chunk_bytes",
                                              "host_reserve_bytes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return (f"CheckpointOffloader(min_bytes={self.min_bytes}, layers={self.layers}, prefetch={self.prefetch}, "
                f"stats={dict(self.stats)})")

    # -- the chain: tensors in the order packed; unpacking one prefetches its predecessor --------
    def new_chain(self) -> None:
        self._last = None
        self._chain_bytes = 0
        model = self._model() if self._model is not None else None
        if model is not None:
            self._parameter_storages = _parameter_storages(model)

    @contextlib.contextmanager
    def hooks(self, offload: bool = True):
        """The saved-tensor hooks, offloading (or, ``offload=False``, only chaining) what they pack."""
        previous, self._offloading = self._offloading, bool(offload)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self._offloading = previous

    def _wanted(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.device.type == "meta" or isinstance(t, torch.nn.Parameter):
            return False
        if isinstance(t._base, torch.nn.Parameter):
            return False
        if t.numel() == 0 or t.numel() * t.element_size() < self.min_bytes:
            # empty (some torch versions save one a checkpoint call): nothing to move, nothing to count
            return False
        return not self._holds_a_parameter(t)

    def _holds_a_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in the excluded model's parameter storages; none once that model is gone, as the
        allocator hands its memory to tensors that would otherwise never be offloaded."""
        if not self._parameter_storages:
            return False
        if self._model is not None and self._model() is None:
            self._parameter_storages = set()
            return False
        return t.untyped_storage().data_ptr() in self._parameter_storages

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor):
        self.stats["packed"] += 1
        prev = self._last
        if not (self._offloading and self._wanted(t)):
            handle = _Kept(t.detach(), prev)  # detached: no reference cycle through an output's grad_fn
            self.stats["kept"] += 1
        else:
            handle = self._to_host(t, prev)
            self.stats["offloaded"] += 1
            self.stats["offloaded_bytes"] += t.numel() * t.element_size()
        if t.numel():
            # an empty tensor stays out: saved beside a layer's input, it would be prefetched instead of the earlier one
            self._last = weakref.ref(handle)
        return handle

    def _to_host(self, t: torch.Tensor, prev) -> _HostCopy:
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        flat = src.view(-1)
        step = max(1, self.chunk_bytes // max(1, src.element_size()))
        self._claim_host_memory(src.numel() * src.element_size())
        if src.device.type != "cuda":
            chunks = [flat[i:i + step].clone() for i in range(0, flat.numel(), step)]
            return _HostCopy(chunks, src.shape, src.dtype, src.device, None, prev)
        pin = True if self.pin_memory is None else bool(self.pin_memory)
        current = torch.cuda.current_stream(src.device)
        side = self._stream(src.device)
        side.wait_stream(current)  # the tensor is complete on the compute stream
        chunks = []
        with torch.cuda.stream(side):
            for i in range(0, flat.numel(), step):
                piece = flat[i:i + step]
                host = torch.empty(piece.numel(), dtype=src.dtype, pin_memory=pin)
                host.copy_(piece, non_blocking=pin)
                chunks.append(host)
            d2h = torch.cuda.Event()
            d2h.record(side)
        src.record_stream(side)  # its memory is not reused before the copy has read it
        return _HostCopy(chunks, src.shape, src.dtype, src.device, d2h, prev)

    def _claim_host_memory(self, nbytes: int) -> None:
        """Refuse a copy that would leave the host less than ``host_reserve_bytes`` (past that the OOM killer ends the
        process silently). Only bytes beyond an earlier chain's are new: the host allocator reuses its pinned blocks."""
        self._chain_bytes += nbytes
        new = self._chain_bytes - self._most_bytes
        if new <= 0:
            return
        available = host_memory_available()
        if available is not None and available - new < self.host_reserve_bytes:
            raise MemoryError(
                f"q35lab: offloading this checkpoint would leave {max(0, available - new) / GiB:.1f} GiB of host "
                f"memory "
                f"(this step holds {self._chain_bytes / GiB:.1f} GiB offloaded; the reserve is "
                f"{self.host_reserve_bytes / GiB:.1f} GiB): offload fewer decoder layers "
                "(apply_to_qwen3_5(offload_checkpoints=...), long_context.plan_offload_layers says how many fit)")
        self._most_bytes = self._chain_bytes

    def _fetch(self, h: _HostCopy) -> None:
        """Start bringing ``h`` back (an event to wait on, on CUDA; at once on a CPU)."""
        if h.device.type != "cuda":
            h.fetched = torch.cat(h.chunks).view(h.shape) if h.chunks else torch.empty(h.shape, dtype=h.dtype)
            return
        side = self._stream(h.device)
        with torch.cuda.stream(side):
            side.wait_event(h.d2h)
            out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # from the side stream's pool
            flat, start = out.view(-1), 0
            for host in h.chunks:
                flat[start:start + host.numel()].copy_(host, non_blocking=True)
                start += host.numel()
            h2d = torch.cuda.Event()
            h2d.record(side)
        h.fetched, h.h2d = out, h2d

    def unpack(self, handle):
        self.stats["unpacked"] += 1
        if isinstance(handle, _Kept):
            out = handle.tensor
        else:
            if handle.fetched is None:
                self._fetch(handle)
            out, handle.fetched = handle.fetched, None  # a retained graph fetches again next time
            if handle.device.type == "cuda":
                current = torch.cuda.current_stream(handle.device)
                current.wait_event(handle.h2d)
                out.record_stream(current)
        prev = handle.prev() if handle.prev is not None else None
        if self.prefetch and isinstance(prev, _HostCopy) and prev.fetched is None:
            self._fetch(prev)
            self.stats["prefetched"] += 1
        return out


@contextlib.contextmanager
def offloaded_checkpoints(model: torch.nn.Module | None = None, *, offloader: CheckpointOffloader | None = None,
                          **settings):
    """Offload what is saved inside the block to host memory (wrap the forward, not the backward)::

        with q35lab.long_context.offloaded_checkpoints(model) as offloader:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    With checkpointed decoder layers, that is their inputs, the final norm's input and the loss's saved tensors.
    ``offload_decoder_layers`` offloads some layers only, without changing the training loop.

    Args:
        model (nn.Module, optional): whose parameters, and tensors sharing their memory, stay. Default: None.
        offloader (CheckpointOffloader, optional): the hooks to use. Default: a new one.
        **settings: ``CheckpointOffloader``'s arguments, for a new one.

    Yields:
        CheckpointOffloader: the hooks in use (``stats`` counts what moved).

    Raises:
        TypeError: ``model`` not a module, ``offloader`` not a ``CheckpointOffloader``, a setting with an offloader.
    """
    if model is not None:
        check_module("model", model)
    if offloader is not None and not isinstance(offloader, CheckpointOffloader):
        raise TypeError(f"offloader: expected a CheckpointOffloader or None, got {type(offloader).__name__}")
    if offloader is not None and settings:
        raise TypeError(f"{', '.join(settings)}: settings of a new CheckpointOffloader, not with offloader")
    offloader = offloader if offloader is not None else CheckpointOffloader(**settings)
    if model is not None:
        offloader.exclude_parameters_of(model)
    offloader.new_chain()
    with offloader.hooks():
        yield offloader


class _OffloadedCheckpoint:
    """A layer's ``_gradient_checkpointing_func`` under the offloader's hooks, offloading in the first ``layers``.

    The one entry every transformers release goes through (5.23 on from the class's ``forward``, below from
    ``GradientCheckpointingLayer.__call__`` around the module call, where hooks in an instance ``forward`` would sit
    inside the checkpoint, offload all the layer saves and break its recompute). Around it they pack only its input,
    ``torch.utils.checkpoint``'s own innermost. An object, not a closure: it deep-copies and pickles with its model."""

    def __init__(self, offloader: CheckpointOffloader, index: int, inner):
        self.offloader, self.index, self.inner = offloader, index, inner

    def __repr__(self) -> str:
        return f"<q35lab offloaded checkpoint of decoder layer {self.index}>"

    def __call__(self, function, *args, **kwargs):
        count = self.offloader.layers
        with self.offloader.hooks(offload=count is None or self.index < count):
            return self.inner(function, *args, **kwargs)


class _OffloadGuard:
    """Forward pre-hook of the module running the decoder layers: each forward starts a new chain and wraps any
    checkpoint function set since (checkpointing enabled again after ``offload_decoder_layers`` sets fresh ones)."""

    def __init__(self, offloader: CheckpointOffloader):
        self.offloader = offloader

    def __call__(self, stack: torch.nn.Module, args):
        self.offloader.new_chain()
        for index, layer in enumerate(stack_layers(stack)):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _OffloadedCheckpoint):
                current.offloader, current.index = self.offloader, index
            elif current is not None:
                layer._gradient_checkpointing_func = _OffloadedCheckpoint(self.offloader, index, current)


def _guards(stack: torch.nn.Module) -> dict:
    return stack_pre_hooks(stack, _OffloadGuard)


def offload_decoder_layers(model: torch.nn.Module, layers: float | int = 1.0, *,
                           offloader: CheckpointOffloader | None = None, **settings) -> CheckpointOffloader:
    """Offload the gradient-checkpoint inputs of the first ``layers`` decoder layers to host memory.

    The first layers: their inputs are needed last in the backward, so their copies have the longest time to go and
    come back. Takes effect while the layers are gradient-checkpointed in train mode (``enable_checkpointing``, before
    or after); calling again updates the count; ``restore_decoder_layers`` undoes it.

    Args:
        model (nn.Module): a transformers model (or a PEFT wrapper) with decoder layers in a ``layers`` list.
        layers (float or int): a fraction of the decoder layers in [0, 1], or a count. Default: 1.0.
        offloader (CheckpointOffloader, optional): the hooks to use. Default: the model's current one, else a new one.
        **settings: ``CheckpointOffloader``'s arguments, for a new one.

    Returns:
        CheckpointOffloader: the hooks in use (``stats`` counts what moved).

    Raises:
        TypeError: ``model`` not a module, ``layers`` not a number, ``offloader`` not a ``CheckpointOffloader``, a
            setting with an offloader.
        ValueError: ``layers`` out of range, a model without decoder layers.
    """
    check_module("model", model)
    stacks = layer_stacks(model)
    found = [layer for stack in stacks for layer in stack_layers(stack)]
    count = layer_count("layers", layers, len(found))
    if not stacks:
        raise ValueError(f"model: expected a transformers model with decoder layers in a `layers` list, "
                         f"got {type(model).__name__}")
    if offloader is not None and not isinstance(offloader, CheckpointOffloader):
        raise TypeError(f"offloader: expected a CheckpointOffloader or None, got {type(offloader).__name__}")
    if offloader is not None and settings:
        raise TypeError(f"{', '.join(settings)}: settings of a new CheckpointOffloader, not with offloader")
    if offloader is None:
        existing = [hook.offloader for stack in stacks for hook in _guards(stack).values()]
        offloader = existing[0] if existing and not settings else CheckpointOffloader(**settings)
    offloader.layers = count
    offloader.exclude_parameters_of(model)
    for stack in stacks:
        remove_stack_pre_hooks(stack, _OffloadGuard)
        guard = _OffloadGuard(offloader)
        stack.register_forward_pre_hook(guard)
        guard(stack, ())  # wrap the checkpoint functions now (the guard does again at each forward)
    return offloader


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer for stack in layer_stacks(model) for layer in stack_layers(stack)]


def restore_decoder_layers(model: torch.nn.Module) -> int:
    """Undo ``offload_decoder_layers``.

    Args:
        model (nn.Module): the model it was given.

    Returns:
        int: how many decoder layers were restored.

    Raises:
        TypeError: ``model`` not a module.
    """
    check_module("model", model)
    restored = 0
    for stack in layer_stacks(model):
        guarded = remove_stack_pre_hooks(stack, _OffloadGuard)
        for layer in stack_layers(stack):
            current = vars(layer).get("_gradient_checkpointing_func")
            if isinstance(current, _OffloadedCheckpoint):
                layer._gradient_checkpointing_func = current.inner
            restored += guarded or isinstance(current, _OffloadedCheckpoint)
    return restored


def host_memory_available() -> int | None:
    """The host memory this process may still take: ``MemAvailable``, capped by a cgroup's limit minus its usage.

    Returns:
        int or None: the bytes, None where unknown.
    """
    available = _meminfo("MemAvailable")
    limit = _cgroup_limit_and_usage()
    if limit is not None:
        room = limit[0] - limit[1]
        available = room if available is None else min(available, room)
    return available


def default_host_reserve(total_bytes: float | None = None) -> int:
    """The host memory an offload leaves free by default: ``HOST_RESERVE_BYTES``, or a quarter of the host if less.

    Args:
        total_bytes (float, optional): the host's memory. Default: this host's (``MemTotal``, or the cgroup's
            limit); where unknown, the reserve is ``HOST_RESERVE_BYTES``.

    Returns:
        int: the bytes to leave free.

    Raises:
        TypeError: ``total_bytes`` not a number.
        ValueError: ``total_bytes`` negative or not finite.
    """
    total = total_bytes
    if total is None:
        total = _meminfo("MemTotal")
        limit = _cgroup_limit_and_usage()
        if limit is not None:
            total = limit[0] if total is None else min(total, limit[0])
    else:
        total = memory_bytes(total, "total_bytes")
    return HOST_RESERVE_BYTES if total is None else int(min(HOST_RESERVE_BYTES, total // 4))


def enable_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> None:
    """Turn on transformers' gradient checkpointing of every decoder layer (``activation_checkpointing_enable``,
    which deprecates ``gradient_checkpointing_enable``, where the release has it).

    Args:
        model (nn.Module): a transformers model, or a PEFT wrapper of one.
        **checkpoint_kwargs: for ``torch.utils.checkpoint.checkpoint``. Default: ``use_reentrant=False`` (what the
            offload and the tiles take).

    Raises:
        TypeError: ``model`` not a transformers model.
    """
    check_module("model", model)
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TypeError(f"model: expected a transformers model (with gradient_checkpointing_enable), "
                        f"got {type(model).__name__}")
    versions.enable_checkpointing(model, **{"use_reentrant": False, **checkpoint_kwargs})


def _meminfo(field: str) -> int | None:
    """One field of /proc/meminfo in bytes, None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit_and_usage() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup (v2, else v1) where it sets a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        return (int(limit), usage) if limit.isdigit() and int(limit) < 2**60 else None
    return None


def has_long_context_options(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a tiled MLP or GatedDeltaNet, or decoder-layer checkpoints offloaded."""
    if any(isinstance(vars(m).get("forward"), TiledForward) for m in model.modules()):
        return True
    return any(bool(_guards(stack))
               or any(isinstance(vars(layer).get("_gradient_checkpointing_func"), _OffloadedCheckpoint)
                      for layer in stack_layers(stack))
               for stack in layer_stacks(model))
