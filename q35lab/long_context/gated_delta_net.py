"""The tiled GatedDeltaNet and its decoder layer: the conv's last K−1 input rows and the delta
rule's state S are carried from tile to tile forward, their gradients backward (a scan, exact)."""

from __future__ import annotations

import functools
import warnings

import torch

from ..hf.gated_delta_net import (
    CausalConv,
    conv_function,
    core_function,
    forward_repeats_key_heads,
    gated_delta_net_problem,
    modeling_module,
    switched_to_q35lab,
)
from ..hf.modules import (
    CACHE_ARGUMENTS,
    checkpoints_the_call,
    has_cache,
    hooks_would_see,
    is_gated_delta_net,
    is_gated_delta_net_layer,
    packed_arguments,
)
from ..ops._autograd import first_order_only
from ..ops._compile import opaque_to_compile
from ..ops.causal_conv1d import causal_conv1d
from .tiles import (
    TiledForward,
    TiledFunction,
    TiledGDNFunction,
    TiledMLPForward,
    Tiles,
    check_tile_tokens,
    put_tiled_forward,
    summed,
    take_tiled_forward,
    tiled_backward,
    tiled_call,
)


class _GatedDeltaNetTile:
    """One tile of a GatedDeltaNet's forward, ``(y, (conv rows, S')) = tile(x, (conv rows, S), span)``::

        x            = x · mask[s:e]                                  (if a padding mask is given)
        qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)
        q, k, v      = split(silu(conv1d([conv rows | qkv])[len(conv rows):]))
        beta, g      = sigmoid(b), −exp(A_log) · softplus(a + dt_bias)
        o, S'        = core(q, k, v, g, beta, initial_state=S, output_final_state=True)
        y            = out_proj(norm(o, z))

    handing on the last K−1 rows of the conv's input, not of x, so that the in_proj (and its LoRA dropout) runs once
    per row. The first tile starts from zeros, as the module does."""

    def __init__(self, gdn: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.gdn, self.mask, self.kwargs = gdn, attention_mask, kwargs
        # resolved once a call: the forward's tiles and their recompute in backward use the same
        self.conv, self.core = conv_function(gdn), core_function(gdn)
        # q35lab's conv takes the carried rows itself: no [K-1+tile, C] concatenation to backpropagate through
        self.conv_carries_rows = isinstance(self.conv, CausalConv)
        self.repeat = forward_repeats_key_heads(type(gdn))
        self.apply_mask = getattr(modeling_module(gdn), "apply_mask_to_padding_states", _apply_mask_to_padding_states)
        self.core_kwargs = {k: v for k, v in kwargs.items() if k != "cu_seq_lens_q"}  # as the forward pops it

    def __call__(self, x: torch.Tensor, carry, span: tuple[int, int]):
        gdn = self.gdn
        start, end = span
        if self.mask is not None:
            x = self.apply_mask(x, self.mask[:, start:end])
        batch, tokens, _ = x.shape
        qkv = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x)
        b = gdn.in_proj_b(x)
        a = gdn.in_proj_a(x)
        previous, state = (None, None) if carry is None else carry
        mixed, rows = self._conv(qkv, previous)
        query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(batch, tokens, -1, gdn.head_k_dim)
        key = key.reshape(batch, tokens, -1, gdn.head_k_dim)
        value = value.reshape(batch, tokens, -1, gdn.head_v_dim)
        beta = b.sigmoid()
        g = -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)
        group = gdn.num_v_heads // gdn.num_k_heads
        if self.repeat and group > 1:
            query = query.repeat_interleave(group, dim=2)
            key = key.repeat_interleave(group, dim=2)
        with switched_to_q35lab(gdn):  # the core as the patched forward calls it
            out, state = self.core(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=None, **self.core_kwargs)
        out = gdn.norm(out.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
        y = gdn.out_proj(out.reshape(batch, tokens, -1))
        return y, (rows, state)

    def _conv(self, qkv: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the conv's output for the tile's rows [B, t, C], the last K−1 rows of [previous | qkv])."""
        gdn = self.gdn
        if self.conv_carries_rows:
            return causal_conv1d(qkv, gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, activation=gdn.activation,
                                 initial_rows=previous, return_final_rows=True)
        tokens = qkv.shape[1]
        rows = qkv if previous is None else torch.cat([previous.to(qkv.dtype), qkv], dim=1)
        mixed = self.conv(rows.transpose(1, 2), gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias,
                          activation=gdn.activation, **self.kwargs)
        keep = min(gdn.conv_kernel_size - 1, rows.shape[1])
        # a copy: a view would keep the whole tile's rows alive until the backward
        return mixed.transpose(1, 2)[:, rows.shape[1] - tokens:], rows[:, rows.shape[1] - keep:].clone()


def _apply_mask_to_padding_states(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states`` (for a modeling module without one)."""
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _check_tiled_call(x, tile_tokens, attention_mask, kwargs: dict, hidden: int, what: str) -> int:
    """The tile size, after checking ``x`` [B, T, hidden], a [B, T] padding mask or None, no packed sequences."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"x: expected [B, T, {hidden}] ({what}'s input), got shape {tuple(x.shape)}")
    tile = check_tile_tokens(tile_tokens)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(x.shape[:2])):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected a 2-D padding mask of shape {tuple(x.shape[:2])} or None, "
                         f"got {got}")
    packed = packed_arguments(kwargs)
    if packed:
        raise ValueError(f"{packed}: packed sequences are not tiled (their boundaries do not line up with tiles); "
                         f"call {what} untiled")
    return tile


@opaque_to_compile  # Python callables inside an autograd Function, per-tile RNG state: eager code
def tiled_gated_delta_net(gdn: torch.nn.Module, x: torch.Tensor, tile_tokens: int, *,
                          attention_mask: torch.Tensor | None = None, preserve_rng_state: bool = True,
                          **kwargs) -> torch.Tensor:
    """A GatedDeltaNet's forward ``gdn(x, attention_mask=...)`` computed ``tile_tokens`` positions at a time, exactly,
    with a backward working set of one tile (``TiledFunction``). Under the layer's checkpoint the recompute needs this
    node's output, so each tile runs forward three times; ``tiled_gated_delta_net_layer`` avoids that. Dropout, RNG,
    autocast and ``retain_graph``: as ``tiled_mlp``.

    Args:
        gdn (nn.Module): transformers' ``Qwen3_5GatedDeltaNet`` (or the MoE one), patched or not, with PEFT or without.
        x (Tensor): its input ``[B, T, H]``.
        tile_tokens (int): positions a tile; at least T runs the module's math once, with grad.
        attention_mask (Tensor, optional): the 2-D padding mask ``[B, T]``.
        preserve_rng_state (bool): replay each tile's RNG in its recompute. Default: True.
        **kwargs: the layer's other keyword arguments, handed to the conv and the core.

    Returns:
        Tensor: ``[B, T, H]``, as the module's.

    Raises:
        TypeError: ``gdn`` not a GatedDeltaNet that can be tiled, ``x`` not a tensor.
        ValueError: a shape, mask or tile size out of contract; packed sequences (``cu_seq_lens_q``)."""
    if not isinstance(gdn, torch.nn.Module) or not is_gated_delta_net(gdn):
        raise TypeError(f"gdn: expected a transformers GatedDeltaNet module, got {type(gdn).__name__}")
    problem = gated_delta_net_problem(gdn)
    if problem:
        raise TypeError(f"gdn: cannot be tiled: {problem}")
    tile = _check_tiled_call(x, tile_tokens, attention_mask, kwargs, gdn.hidden_size, "the GatedDeltaNet")
    step = _GatedDeltaNetTile(gdn, attention_mask, kwargs)
    tokens = x.shape[1]
    if tile >= tokens or tokens == 0:
        return step(x, None, (0, tokens))[0]
    params = tuple(p for p in gdn.parameters() if p.requires_grad)
    tiles = Tiles(step, tile, bool(preserve_rng_state), x.device, scan=True, name="GatedDeltaNet tile")
    # not stashed: the layer's recompute needs this node's output anyway
    return tiled_call(TiledGDNFunction, tiles, x, params, stash=False)


class _GatedDeltaNetLayerTile:
    """One tile of a GatedDeltaNet decoder layer, its output ``h + m`` as two addends (``Tiles``)::

        h, carry' = x + GatedDeltaNet_tile(input_layernorm(x), carry);  m = mlp(post_attention_layernorm(h))"""

    def __init__(self, layer: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.layer = layer
        self.mixer = _GatedDeltaNetTile(layer.linear_attn, attention_mask, kwargs)
        # the MLP untiled: the layer's tile bounds it, and a nested tiling hides its down GEMM from _recompute_tile
        forward = vars(layer.mlp).get("forward")
        self.mlp = forward.untiled if isinstance(forward, TiledMLPForward) else layer.mlp

    def __call__(self, x: torch.Tensor, carry, span: tuple[int, int]):
        layer = self.layer
        mixed, carry = self.mixer(layer.input_layernorm(x), carry, span)
        h = x + mixed
        return (h, self.mlp(layer.post_attention_layernorm(h))), carry


class TiledGDNLayerFunction(TiledFunction):
    """``TiledFunction`` of ``_GatedDeltaNetLayerTile``: the node of ``tiled_gated_delta_net_layer``."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        return tiled_backward(ctx, grad_out)


def _check_gated_delta_net_layer(layer) -> None:
    if not isinstance(layer, torch.nn.Module) or not is_gated_delta_net_layer(layer):
        raise TypeError(f"layer: expected a transformers GatedDeltaNet decoder layer with a per-token MLP, "
                        f"got {type(layer).__name__}")


@opaque_to_compile  # as tiled_gated_delta_net
def tiled_gated_delta_net_layer(layer: torch.nn.Module, x: torch.Tensor, tile_tokens: int, *,
                                attention_mask: torch.Tensor | None = None, preserve_rng_state: bool = True,
                                **kwargs) -> torch.Tensor:
    """A GatedDeltaNet decoder layer's forward ``layer(x, attention_mask=...)`` computed ``tile_tokens`` positions at
    a time, exactly, the whole layer in each tile: the layer checkpoint's recompute then stops at the stashed input
    instead of rerunning every tile for the GatedDeltaNet's output, and the carries, hidden from the checkpoint, live
    until the layer's backward. Hooks on its GatedDeltaNet or MLP are not called. Otherwise (arguments, result,
    errors, dropout, autocast) as ``tiled_gated_delta_net``, for a layer ``is_gated_delta_net_layer`` accepts."""
    _check_gated_delta_net_layer(layer)
    problem = gated_delta_net_problem(layer.linear_attn)
    if problem:
        raise TypeError(f"layer: its GatedDeltaNet cannot be tiled: {problem}")
    tile = _check_tiled_call(x, tile_tokens, attention_mask, kwargs, layer.linear_attn.hidden_size, "the layer")
    step = _GatedDeltaNetLayerTile(layer, attention_mask, kwargs)
    tokens = x.shape[1]
    if tile >= tokens or tokens == 0:
        return summed(step(x, None, (0, tokens))[0])
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    tiles = Tiles(step, tile, bool(preserve_rng_state), x.device, scan=True, name="GatedDeltaNet layer tile")
    return tiled_call(TiledGDNLayerFunction, tiles, x, params, stash=True, hide_saved=True)


class TiledGDNForward(TiledForward):
    """A GatedDeltaNet's forward through ``tiled_gated_delta_net`` when it trains on more than a tile. Untiled: no
    grad, one tile, a positional call, accelerate's hooks on the conv; with a warning, a cache or packed sequences,
    whose state tiles cannot carry."""

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if self._untiled_because(x, args, kwargs):
            return self.untiled(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "attention_mask", *CACHE_ARGUMENTS)}
        return tiled_gated_delta_net(self.module, x, self.tile_tokens, attention_mask=kwargs.get("attention_mask"),
                                     **rest)

    def _untiled_because(self, x, args: tuple, kwargs: dict) -> str | None:
        nothing_to_tile = self.nothing_to_tile(x, args)
        if nothing_to_tile:
            return nothing_to_tile
        if getattr(self.module.conv1d, "_hf_hook", None) is not None:
            return "accelerate hooks"
        why, packed = None, packed_arguments(kwargs)
        if has_cache(kwargs):
            why = ("a cache was passed (generation, or use_cache=True in a forward without gradient checkpointing: "
                   "pass use_cache=False)")
        elif packed:
            why = f"packed sequences ({packed}) do not line up with tiles"
        if why:
            warnings.warn(f"q35lab: tiled GatedDeltaNet ({self.tile_tokens} tokens a tile) runs untiled here: {why}; "
                          "its backward then holds the whole sequence's working set", stacklevel=3)
        return why


class TiledGDNLayerForward(TiledForward):
    """A GatedDeltaNet decoder layer's forward through ``tiled_gated_delta_net_layer`` when it trains on
    more than a tile; untiled where its GatedDeltaNet would be, and where hooks or accelerate watch it."""

    #: the layer's own arguments, which its GatedDeltaNet does not take
    LAYER_ARGUMENTS = ("hidden_states", "attention_mask", "position_embeddings", "position_ids", *CACHE_ARGUMENTS)

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if self._untiled(x, args, kwargs):
            return self.untiled(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in self.LAYER_ARGUMENTS}
        tiled = functools.partial(tiled_gated_delta_net_layer, self.module, tile_tokens=self.tile_tokens,
                                  attention_mask=kwargs.get("attention_mask"), **rest)
        layer = self.module
        if layer.gradient_checkpointing and layer.training and not checkpoints_the_call():
            # a transformers that checkpoints the class's forward (replaced here): checkpoint as it would
            return layer._gradient_checkpointing_func(tiled, x)
        return tiled(x)

    def _untiled(self, x, args: tuple, kwargs: dict) -> bool:
        if self.nothing_to_tile(x, args):
            return True
        layer = self.module
        gdn = layer.linear_attn
        return (has_cache(kwargs) or packed_arguments(kwargs) is not None or gated_delta_net_problem(gdn) is not None
                # hooks the tiles would not call as the layer does, and a forward wrapped before (accelerate)
                or hooks_would_see(gdn, layer.mlp) or self.inner is not None
                or any(getattr(m, "_hf_hook", None) is not None for m in (layer, gdn.conv1d)))


def tile_gated_delta_net(gdn: torch.nn.Module, tile_tokens: int) -> bool:
    """``put_tiled_forward`` of a ``TiledGDNForward`` (``TypeError`` where ``gated_delta_net_problem`` objects): call
    after any patch that sets the forward, and ``untile_gated_delta_net`` before undoing it."""
    problem = gated_delta_net_problem(gdn)
    if problem:
        raise TypeError(f"gdn: cannot be tiled: {problem}")
    return put_tiled_forward(gdn, tile_tokens, TiledGDNForward)


def untile_gated_delta_net(gdn: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net`` wrapped; True if there was a tiled one."""
    return take_tiled_forward(gdn, TiledGDNForward)


def tile_gated_delta_nets(model: torch.nn.Module, tile_tokens: int) -> int:
    """``tile_gated_delta_net`` on every GatedDeltaNet of ``model`` that can be tiled, ``tile_gated_delta_net_layer``
    on every decoder layer of one with a per-token MLP; how many modules were new."""
    new = 0
    for m in model.modules():
        if is_gated_delta_net(m) and gated_delta_net_problem(m) is None:
            new += tile_gated_delta_net(m, tile_tokens)
        elif is_gated_delta_net_layer(m) and gated_delta_net_problem(m.linear_attn) is None:
            new += tile_gated_delta_net_layer(m, tile_tokens)
    return new


def untile_gated_delta_nets(model: torch.nn.Module) -> int:
    """Undo ``tile_gated_delta_nets`` on ``model``; how many modules were untiled."""
    return sum(untile_gated_delta_net(m) or untile_gated_delta_net_layer(m) for m in model.modules())


def tile_gated_delta_net_layer(layer: torch.nn.Module, tile_tokens: int) -> bool:
    """``put_tiled_forward`` of a ``TiledGDNLayerForward`` (``TypeError`` where ``is_gated_delta_net_layer``
    refuses)."""
    _check_gated_delta_net_layer(layer)
    return put_tiled_forward(layer, tile_tokens, TiledGDNLayerForward)


def untile_gated_delta_net_layer(layer: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net_layer`` wrapped; True if there was a tiled one."""
    return take_tiled_forward(layer, TiledGDNLayerForward)
