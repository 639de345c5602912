"""The sequence-tiling engine and the tiled MLP: a module that is per token, or carries its only sequence state
across tiles, runs a tile of tokens at a time, and its backward recomputes each tile from its saved input (and carry),
holding one tile's intermediates instead of the sequence's. Exact: the same operations on the same rows."""

from __future__ import annotations

import contextlib
import functools

import torch

from ..hf.forwards import Forward
from ..hf.modules import is_mlp
from ..ops._autograd import first_order_only
from ..ops._checks import check_int, check_module
from ..ops._compile import opaque_to_compile
from ..ops._prepared import shared_preparations
from ..ops.swiglu_down import is_unread, unread_down_outputs


class Tiles:
    """What a tiled Function's backward needs besides tensors (plain attributes, never saved): the per-tile ``fn``,
    the tiling, the forward's autocast state and each tile's RNG state.

    ``fn`` is a per-token map ``fn(piece) -> y`` (``scan=False``) or a scan step ``fn(piece, carry, (start, end)) ->
    (y, carry)`` (``scan=True``), ``carry`` being None for the first tile, else the tensors the previous one returned.
    ``y`` may be a tuple of addends (a layer's residual and MLP output): the forward writes their sum, the backward
    roots each on the same gradient so that the MLP's output can stay uncomputed (``_recompute_tile``)."""

    def __init__(self, fn, tile: int, preserve_rng_state: bool, device: torch.device, *, scan: bool = False,
                 name: str = "mlp_forward"):
        self.fn, self.tile, self.preserve_rng_state, self.scan, self.name = fn, tile, preserve_rng_state, scan, name
        self.device_type = device.type
        # the device whose RNG dropout draws from (none for a CPU input: the CPU state is always kept)
        self.rng_devices = ([device.index if device.index is not None else 0]
                            if device.type not in ("cpu", "meta") else [])
        self.autocast = _autocast_state(device.type)
        self.rng_states: list = []
        self.stash = None  # the _StashInput node that holds x, when there is one

    def bounds(self, tokens: int):
        return [(start, min(start + self.tile, tokens)) for start in range(0, tokens, self.tile)]

    def step(self, piece: torch.Tensor, carry, span: tuple[int, int]):
        """(the tile's output, the carry it hands on): a per-token map hands on nothing."""
        if self.scan:
            return self.fn(piece, carry, span)
        return self.fn(piece), None

    def record_rng(self) -> None:
        device_states = [_device_module(self.device_type).get_rng_state(d) for d in self.rng_devices]
        self.rng_states.append((torch.get_rng_state(), device_states))

    def restore_rng(self, index: int) -> None:
        cpu_state, device_states = self.rng_states[index]
        torch.set_rng_state(cpu_state)
        for d, state in zip(self.rng_devices, device_states):
            _device_module(self.device_type).set_rng_state(state, d)


def _device_module(device_type: str):
    return getattr(torch, device_type)


def _autocast_state(device_type: str) -> dict:
    """The forward's autocast state, re-entered by the recompute (the backward runs on another thread on CUDA, and
    outside the caller's ``autocast`` block on the CPU)."""
    state = {"cpu": dict(enabled=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu"),
                         cache_enabled=torch.is_autocast_cache_enabled())}
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        state[device_type] = dict(enabled=torch.is_autocast_enabled(device_type),
                                  dtype=torch.get_autocast_dtype(device_type),
                                  cache_enabled=torch.is_autocast_cache_enabled())
    return state


@contextlib.contextmanager
def _autocast(state: dict):
    with contextlib.ExitStack() as stack:
        for device_type, kwargs in state.items():
            stack.enter_context(torch.amp.autocast(device_type, **kwargs))
        yield


def _run_tiles(tiles: Tiles, x: torch.Tensor, record_rng: bool, keep_carries: bool = True) -> tuple[torch.Tensor, list]:
    """``fn`` over each tile of ``x`` (dim -2) into one output; returns it and the carry that entered each tile
    (None for the first, and for a per-token map). ``keep_carries=False``: no backward to come, none kept."""
    tokens = x.shape[-2]
    out, carry, carries = None, None, []
    with shared_preparations():  # the projections' weight-only casts: built by the first tile, reused
        for start, end in tiles.bounds(tokens):
            if record_rng:
                tiles.record_rng()
            if keep_carries:
                carries.append(carry)
            # detached: a no-grad view of an input requiring grad has no node, which ModuleTracker's input hooks reject
            piece = x[..., start:end, :].detach()
            y, carry = tiles.step(piece, carry, (start, end))
            y = summed(y)
            if not isinstance(y, torch.Tensor) or y.dim() != piece.dim() or y.shape[:-1] != piece.shape[:-1]:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(f"{tiles.name}: expected a tensor of shape {tuple(piece.shape[:-1])} + (N,) for a "
                                 f"tile of shape {tuple(piece.shape)}, got {got}")
            if out is None:
                out = y.new_empty((*x.shape[:-2], tokens, y.shape[-1]))
            out[..., start:end, :].copy_(y)
    return out, carries


def _flatten_carries(carries: list) -> tuple[list, list]:
    """The carries' tensors in one list (for ``save_for_backward``) and each carry's count (0: None)."""
    sizes = [0 if c is None else len(c) for c in carries]
    return [t for c in carries if c is not None for t in c], sizes


def _unflatten_carries(flat, sizes: list) -> list:
    carries, at = [], 0
    for n in sizes:
        carries.append(None if n == 0 else tuple(flat[at:at + n]))
        at += n
    return carries


def _carry_leaves(carry):
    """A saved carry as fresh leaves of the recompute, those of a float dtype requiring grad."""
    if carry is None:
        return None
    return tuple(c.detach().requires_grad_(c.is_floating_point()) for c in carry)


class _StashInput(torch.autograd.Function):
    """Saves the tiled node's input in a node of its own, before any tile runs. A non-reentrant checkpoint's
    recompute stops (early stop, the default) once the last tensor the forward saved is saved again: in a Qwen3.5
    layer the MLP's input, as the residual add after it saves nothing. A Function's own ``save_for_backward`` packs
    only after its forward returns, so the recompute would rerun every tile; packed here first, it stops before them."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)  # internal: only the tiled Function reads it

    @staticmethod
    def backward(ctx, grad):
        return grad


class TiledFunction(torch.autograd.Function):
    """``y[..., s:e, :], c_i = fn(x[..., s:e, :], c_{i-1})`` for each tile ``[s, e)`` (a per-token map: no c).

    Forward, without grad: one ``[..., T, N]`` output; only the carries entering each tile are saved (a checkpoint
    around the caller drops and recomputes them, unless ``tiled_call`` hides them). Backward (``tiled_backward``),
    tiles in reverse (a per-token map's in order): each is recomputed with grad from its rows and carry, under its
    recorded RNG state and the forward's autocast, and ``autograd.grad`` of (its ``dy``, the gradient of the carry it
    handed on) gives its ``dx``, its incoming carry's gradient and its parameter gradients, summed over tiles (fp32 for
    16-bit parameters). Parameters are inputs of the node, so ``autograd.grad``, hooks and accumulation behave as
    untiled. Subclasses name the op for the second-derivative error."""

    @staticmethod
    def forward(ctx, tiles: Tiles, x: torch.Tensor, *params: torch.Tensor):
        out, carries = _run_tiles(tiles, x, record_rng=tiles.preserve_rng_state)
        flat, ctx.carry_sizes = _flatten_carries(carries)
        ctx.tiles = tiles
        ctx.params = params  # references, not saved tensors: no pack, no recompute of a parameter
        ctx.save_for_backward(*(() if tiles.stash is not None else (x,)), *flat)
        return out


def _addends(y) -> tuple:
    return y if isinstance(y, tuple) else (y,)


def summed(y):
    """A tile's output: ``y``, or the sum of its addends."""
    return functools.reduce(torch.add, _addends(y))


def _recompute_tile(tiles: Tiles, piece: torch.Tensor, carry_in, span: tuple[int, int], index: int):
    """Tile ``index``'s forward again, with grad: ``(addends of y, carry)``.

    ``y`` only roots the backward, and the down GEMM of ``swiglu_down`` (a patched MLP's output, a layer's last
    addend) needs only ``dy`` there, so it is skipped (``unread_down_outputs``), as the untiled checkpoint's recompute
    skips it: 2·T·I·H FLOPs a layer. Unless exactly one GEMM was skipped and its output is the last addend unmodified
    (two would mean chained MLPs, one reading the other's), the tile runs again in full, its RNG restored. A scan's
    carry comes from the mixer, before the MLP."""
    with unread_down_outputs() as skipped:
        y, carry = tiles.step(piece, carry_in, span)
    if not skipped or (len(skipped) == 1 and is_unread(_addends(y)[-1], skipped)):
        return _addends(y), carry
    del y, carry  # the first pass's graph holds its saved tensors: not alive beside the second's
    skipped.clear()
    if tiles.preserve_rng_state:
        tiles.restore_rng(index)
    y, carry = tiles.step(piece, carry_in, span)
    return _addends(y), carry


def tiled_backward(ctx, grad_out):
    """The backward of ``TiledFunction`` (see there)."""
    tiles = ctx.tiles
    saved = ctx.saved_tensors
    if tiles.stash is not None:
        (x,) = tiles.stash.saved_tensors
    else:
        x, saved = saved[0], saved[1:]
    carries = _unflatten_carries(saved, ctx.carry_sizes)
    want_x = ctx.needs_input_grad[1]
    wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[2 + i]]
    dx = torch.empty_like(x) if want_x else None
    sums: dict[int, torch.Tensor] = {}
    handed_back = None  # the gradient of the carry the tile being recomputed hands on (tile i+1's)
    bounds = tiles.bounds(x.shape[-2])
    with torch.random.fork_rng(devices=tiles.rng_devices, enabled=tiles.preserve_rng_state,
                               device_type=tiles.device_type if tiles.rng_devices else "cuda"), shared_preparations():
        order = reversed(range(len(bounds))) if tiles.scan else range(len(bounds))
        for index in order:
            start, end = bounds[index]
            if tiles.preserve_rng_state:
                tiles.restore_rng(index)
            with torch.enable_grad(), _autocast(tiles.autocast):
                leaf = x[..., start:end, :].detach().requires_grad_(want_x)
                # a view: ModuleTracker (FlopCounterMode) hooks its inputs' gradients, which a leaf refuses in grad()
                piece = leaf.view_as(leaf) if want_x else leaf
                carry_in = _carry_leaves(carries[index])
                addends, carry_out = _recompute_tile(tiles, piece, carry_in, (start, end), index)
            pairs = [(y, grad_out[..., start:end, :]) for y in addends]
            if handed_back is not None:
                pairs += [(c, g) for c, g in zip(carry_out, handed_back) if g is not None]
            pairs = [(o, g) for o, g in pairs if o.requires_grad]
            leaves = [c for c in carry_in or () if c.requires_grad]
            inputs = ([leaf] if want_x else []) + leaves + [ctx.params[i] for i in wanted]
            grads = (torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                     if pairs and inputs else (None,) * len(inputs))
            grads = list(grads)
            if want_x:
                g = grads.pop(0)
                if g is None:  # the tile's output does not depend on its input
                    dx[..., start:end, :].zero_()
                else:
                    dx[..., start:end, :].copy_(g)
            carry_grads = iter(grads[:len(leaves)])
            handed_back = None if carry_in is None else [next(carry_grads) if c.requires_grad else None
                                                         for c in carry_in]
            totals, addends = [], []
            for i, g in zip(wanted, grads[len(leaves):]):
                if g is None:
                    continue
                if i not in sums:
                    sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g.clone()
                else:
                    totals.append(sums[i])
                    addends.append(g)
            if totals:  # one multi-tensor launch a tile, not one small kernel per parameter
                torch._foreach_add_(totals, addends)
    param_grads = []
    for i, p in enumerate(ctx.params):
        g = sums.get(i)
        param_grads.append(None if g is None else g.to(p.dtype))
    return (None, dx, *param_grads)


class TiledMLPFunction(TiledFunction):
    """``tiled_mlp``'s node: a per-token map."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return tiled_backward(ctx, grad_out)


class TiledGDNFunction(TiledFunction):
    """``tiled_gated_delta_net``'s node: a scan carrying the conv's last K−1 input rows and the recurrent state."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return tiled_backward(ctx, grad_out)


def check_tile_tokens(tile_tokens: object, name: str = "tile_tokens", what: str = "tokens per tile",
                       minimum: int = 1) -> int:
    """A count of tokens: an int of at least ``minimum`` (a tile's size and a step's: 1)."""
    return check_int(name, tile_tokens, minimum=minimum, what=what)


def _parameters_of(fn) -> list[torch.Tensor] | None:
    """The trainable parameters of the module ``fn`` is, is a bound method of, or holds as ``.module``; else None."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "module", getattr(fn, "__self__", None))
    if isinstance(owner, torch.nn.Module):
        return [p for p in owner.parameters() if p.requires_grad]
    return None


def _check_params(params) -> tuple:
    params = tuple(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}]: expected a torch.Tensor, got {type(p).__name__}")
    return params


@opaque_to_compile  # Python callables inside an autograd Function, per-tile RNG state: eager code
def tiled_mlp(mlp_forward, x: torch.Tensor, tile_tokens: int, *, params=None,
              preserve_rng_state: bool = True) -> torch.Tensor:
    """``mlp_forward(x)`` computed ``tile_tokens`` positions (dim -2) at a time, exactly.

    ``mlp_forward`` maps ``[..., t, H]`` to ``[..., t, N]`` token by token (``Qwen3_5MLP``, patched or not, or any
    per-token callable). Each tile runs without grad in the forward and again with grad in the backward, only ``x``
    kept between: per token the backward holds ``x`` and ``dx`` (2H·e) instead of about (H + 4I)·e (e: activation
    bytes, I: the MLP's width). ``params``: the tensors gradients flow to; default the trainable parameters of the
    module ``mlp_forward`` is, is a method of, or holds as ``.module`` (a plain function passes them, ``()`` if none).

    Under the layer's non-reentrant checkpoint the MLP FLOPs are the untiled MLP's: the layer's recompute stops at
    ``x`` (``_StashInput``) and the tiles' skips a patched MLP's down GEMM (``_recompute_tile``). One down projection
    more a tile where it is not ``swiglu_down``'s frozen GEMM (PEFT's or transformers' forward, ``lora=False``, a
    trainable down weight, down-adapter dropout, a hook on ``down_proj``, autocast to another dtype); each tile's
    forward twice for a callable that reads the skipped output; one MLP forward more without a checkpoint or with
    ``set_checkpoint_early_stop(False)``.

    Dropout: each tile's CPU and device RNG state is replayed in its recompute, the global state restored after; masks
    differ from the untiled MLP's, as with any batch shape. Autocast is re-entered; ``retain_graph`` and
    ``autograd.grad`` work; a second derivative raises. ``tile_tokens`` ≥ T, T = 0 or nothing requiring grad:
    ``mlp_forward(x)`` as it is (the last tile by tile, without grad)."""
    if not callable(mlp_forward):
        raise TypeError(f"mlp_forward: expected a callable, got {type(mlp_forward).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x: expected [..., T, H] (at least 2 dimensions), got shape {tuple(x.shape)}")
    tile = check_tile_tokens(tile_tokens)
    tokens = x.shape[-2]
    if tile >= tokens or tokens == 0:
        return mlp_forward(x)
    if params is None:
        params = _parameters_of(mlp_forward)
        if params is None:
            raise TypeError("params: mlp_forward is neither a module nor holds one; pass the tensors its gradients "
                            "flow to (params=() if none)")
    params = _check_params(params)
    tiles = Tiles(mlp_forward, tile, bool(preserve_rng_state), x.device)
    return tiled_call(TiledMLPFunction, tiles, x, params, stash=True)


def tiled_call(function: type, tiles: Tiles, x: torch.Tensor, params, stash: bool,
                hide_saved: bool = False) -> torch.Tensor:
    """``function.apply(tiles, x, *params)``, ``x`` first saved by its own node if ``stash`` (``_StashInput``); with
    no backward to come, tile by tile without grad. ``hide_saved``: what the node saves is packed as is, under hooks
    of its own that a checkpoint's or the offload's around the caller do not see, so the checkpoint's recompute stops
    at the stash and the carries are freed once the node's backward has run."""
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        with torch.no_grad():
            return _run_tiles(tiles, x, record_rng=False, keep_carries=False)[0]
    if stash and x.requires_grad:
        x = _StashInput.apply(x)
        tiles.stash = x.grad_fn
    if not hide_saved:
        return function.apply(tiles, x, *params)
    with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
        return function.apply(tiles, x, *params)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class TiledForward(Forward):
    """A module's instance-level forward that tiles the forward it replaced (``inner``, else the class's), which it
    calls for what it does not tile; a ``Forward``, so it deep-copies and pickles with its module."""

    #: steps of at most this many tokens (rows × sequence) run untiled (``tile_only_above``); 0: none
    untiled_up_to = 0

    def __init__(self, module: torch.nn.Module, tile_tokens: int, inner=None):
        super().__init__(module)
        self.tile_tokens = check_tile_tokens(tile_tokens)
        self.inner = inner  # the instance-level forward replaced (None: the class's)

    def _details(self) -> str:
        return f", {self.tile_tokens} tokens a tile"

    def nothing_to_tile(self, x, args: tuple) -> str | None:
        """Why a call (``x`` [B, T, H], the only positional argument) has nothing to tile, or None."""
        if len(args) > 1 or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return "a call the tiles do not take"
        if x.shape[1] <= self.tile_tokens:
            return "one tile"
        if x.shape[0] * x.shape[1] <= self.untiled_up_to:
            return "fits untiled"
        if not torch.is_grad_enabled() or not (x.requires_grad
                                               or any(p.requires_grad for p in self.module.parameters())):
            return "no grad"
        return None

    def untiled(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class TiledMLPForward(TiledForward):
    """An MLP's forward through ``tiled_mlp``; calls with extra arguments go to the wrapped forward untiled."""

    def __call__(self, x, *args, **kwargs):
        if (args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2
                or x.shape[:-1].numel() <= self.untiled_up_to):
            return self.untiled(x, *args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_mlp(self.untiled, x, self.tile_tokens, params=params)


def put_tiled_forward(module: torch.nn.Module, tile_tokens: int, forward_class: type) -> bool:
    """Give ``module`` a ``forward_class`` around its current forward; True if it had none (an existing one takes
    the new tile size, and tiles every sequence longer than it again)."""
    tile_tokens = check_tile_tokens(tile_tokens)
    current = vars(module).get("forward")
    if isinstance(current, forward_class):
        current.tile_tokens = tile_tokens
        vars(current).pop("untiled_up_to", None)
        return False
    module.forward = forward_class(module, tile_tokens, inner=current)
    return True


def take_tiled_forward(module: torch.nn.Module, forward_class: type) -> bool:
    current = vars(module).get("forward")
    if not isinstance(current, forward_class):
        return False
    if current.inner is None:
        del module.forward
    else:
        module.forward = current.inner
    return True


def tile_mlp(mlp: torch.nn.Module, tile_tokens: int) -> bool:
    """``put_tiled_forward`` of a ``TiledMLPForward``: call after any patch that sets the MLP's forward (swiglu), and
    ``untile_mlp`` before undoing it."""
    return put_tiled_forward(mlp, tile_tokens, TiledMLPForward)


def untile_mlp(mlp: torch.nn.Module) -> bool:
    """Put back the forward ``tile_mlp`` wrapped; True if there was a tiled one."""
    return take_tiled_forward(mlp, TiledMLPForward)


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """``tile_mlp`` on every Qwen3.5 MLP of ``model`` (PEFT wrappers included); how many were new."""
    return sum(tile_mlp(m, tile_tokens) for m in model.modules() if is_mlp(m))


def untile_mlps(model: torch.nn.Module) -> int:
    return sum(untile_mlp(m) for m in model.modules() if is_mlp(m))


def tile_only_above(model: torch.nn.Module, tokens: int) -> int:
    """Let every tiled MLP, GatedDeltaNet and decoder layer of ``model`` run untiled in a step of at most ``tokens``
    tokens (rows × sequence): tiles trade launches for memory. ``apply_to_qwen3_5(long_context=N)`` sets it to the
    plan's ``untiled_up_to``.

    Args:
        model (nn.Module): a model patched with tiles.
        tokens (int): the longest step to run untiled; 0 tiles every sequence longer than a tile.

    Returns:
        int: how many tiled modules there were.

    Raises:
        TypeError: ``model`` not a module, ``tokens`` not an int.
        ValueError: ``tokens`` below 0.
    """
    check_module("model", model)
    tokens = check_tile_tokens(tokens, "tokens", "the longest step to run untiled", minimum=0)
    tiled = [forward for m in model.modules() if isinstance(forward := vars(m).get("forward"), TiledForward)]
    for forward in tiled:
        forward.untiled_up_to = tokens
    return len(tiled)
