"""The tiled GatedDeltaNet and its decoder layer.

Its only state along the sequence is the causal conv's last K-1 input rows and the delta rule's
recurrent state S: both are carried from tile to tile in the forward, and their gradients from
tile to tile in the backward (a scan, exact)."""

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
    """One tile of a GatedDeltaNet's forward: ``(y, (conv rows, S)) = tile(x, (conv rows, S), span)``.

    What transformers' ``Qwen3_5GatedDeltaNet.forward`` computes (5.15 to 5.25, without a cache),
    on the tile's rows, with the module's own pieces::

        x            = x · mask[s:e]                          (padding rows zeroed; if a mask is given)
        qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)   (one fused node, patched)
        rows         = [conv rows | qkv]                     (the previous tile's last K−1 qkv rows)
        q, k, v      = split(conv1d(rows)[drop the first len(conv rows)])        (silu)
        beta, g      = sigmoid(b), −exp(A_log) · softplus(a + dt_bias)           (fp32 g)
        o, S'        = core(q, k, v, g, beta, initial_state=S, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)    (q, k repeated by num_v_heads // num_k_heads,
                                                               as the forward would)
        y            = out_proj(norm(o, z))

    and hands on ``(last K−1 rows of [conv rows | qkv], S')``. q35lab's conv (patched) takes the
    carried rows as its initial rows and gives the last ones (``causal_conv1d(initial_rows=,
    return_final_rows=True)``): ``rows`` is never made; any other conv gets the concatenation.
    The first tile has no carry (the conv pads with zeros, S starts at zero: the module's own
    start). A tile shorter than K−1 hands on rows of earlier tiles too, so the conv of every
    tile sees exactly the rows it would see untiled. The carry is the conv's *input*, not x: the
    in_proj runs once per row, so LoRA dropout draws one mask per row as in the untiled module.
    """

    def __init__(self, gdn: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.gdn, self.mask, self.kwargs = gdn, attention_mask, kwargs
        # resolved once a call: the forward's tiles and their recompute in backward use the same
        self.conv, self.core = conv_function(gdn), core_function(gdn)
        # q35lab's kernel reads the carried rows where the tile's first rows' window starts and hands on
        # its last ones: no [K-1+tile, C] concatenation, whose slices' gradients cost three passes over it
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
        with switched_to_q35lab(gdn):  # q35lab's wrapper of the core, as in the patched forward (q, k, v copied for fla)
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
    """The tile size, after checking a tiled GatedDeltaNet's (or its layer's) call: ``x`` [B, T,
    hidden], a 2-D padding mask of [B, T] or None, no packed sequences (``ValueError`` naming the
    argument)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"x: expected [B, T, {hidden}] ({what}'s input), got shape {tuple(x.shape)}")
    tile = check_tile_tokens(tile_tokens)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(x.shape[:2])):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected a 2-D padding mask of shape {tuple(x.shape[:2])} or None, got {got}")
    packed = packed_arguments(kwargs)
    if packed:
        raise ValueError(f"{packed}: packed sequences are not tiled (their boundaries do not line up with tiles); "
                         f"call {what} untiled")
    return tile


@opaque_to_compile  # Python callables inside an autograd Function, per-tile RNG state: eager code
def tiled_gated_delta_net(gdn: torch.nn.Module, x: torch.Tensor, tile_tokens: int, *,
                          attention_mask: torch.Tensor | None = None, preserve_rng_state: bool = True,
                          **kwargs) -> torch.Tensor:
    """A GatedDeltaNet's forward ``gdn(x, attention_mask=...)`` computed ``tile_tokens`` positions
    of the sequence at a time: exactly the module's function (not an approximation), with the
    backward's working set of one tile instead of the sequence's.

    ``gdn``: transformers' ``Qwen3_5GatedDeltaNet`` (or the MoE one), as it is or patched by
    q35lab (its fused in_proj, causal conv and gated norm are what each tile calls), with PEFT
    LoRA adapters or without; ``x``: its input ``[B, T, H]``; ``attention_mask``: the 2-D padding
    mask the model hands it (rows zeroed token by token, as the module does); ``kwargs``: the rest
    of the layer's keyword arguments, passed to the conv and the core as the module passes them.
    Packed sequences (``cu_seq_lens_q``) are refused (``ValueError``): their boundaries do not
    line up with tiles; ``TiledGDNForward`` runs such calls untiled.

    Each tile is ``_GatedDeltaNetTile``: the per-token parts on the tile's rows; the conv over the
    previous tile's last K−1 conv-input rows followed by the tile's (K = 4); the delta-rule core
    from the previous tile's final state S (``initial_state``, ``output_final_state=True``:
    transformers' PyTorch core and fla's ``chunk_gated_delta_rule`` take both, and fla's backward
    takes the final state's gradient ``dht`` and returns the initial state's — read from fla's code,
    to be confirmed on the GPU). Forward: tiles in order without grad, keeping only the
    carry into each tile — K−1 conv rows ([B, 3, 8192] bf16, 48 KiB) and S ([B, 32, 128, 128]
    fp32, 2 MiB, at 9B) — and the caller's ``x``. Backward (``TiledGDNFunction``): tiles in
    reverse, each recomputed with grad from its rows of ``x`` and its carry (leaves), backpropagated
    from (its ``dy``, the next tile's gradient of the carry) to ``dx``, the previous carry's
    gradient and every trainable parameter's (LoRA adapters, and A_log, dt_bias, the conv or the
    norm if they train).

    Memory (9B, bf16, per token): untiled, the GatedDeltaNet's backward holds ~181 KiB a token of
    its own (the in_proj output, z, the core's q, k, v, the WY matrix, its recomputed w, u and h,
    dh, dq, dk, dv, the norm's input and output, ...; 221 KiB with the checkpoints and residual
    gradients, ``bytes_per_token``). Tiled, the sequence holds ``x`` and ``dx`` (2H·e = 16 KiB a
    token) and the carries (2 MiB + 48 KiB a tile: 262 B a token at 8192-token tiles); the rest
    exists for one tile at a time.

    Passes: without outer checkpointing, each tile's forward runs twice (forward, and recompute in
    backward) and its backward once. Under the decoder layer's non-reentrant checkpoint, three
    times: the checkpoint's recompute needs the GatedDeltaNet's output to rebuild what the layer's
    later ops save (the post-attention norm's input, the MLP's input), and only a tile forward
    gives it — avoiding that pass would take keeping a [T, H] output per layer, which is what the
    checkpoint exists to drop. That is one GatedDeltaNet forward more than the untiled layer
    (8–10% of a GatedDeltaNet layer's step at 9B by GEMM FLOPs; the tiled MLP after it keeps its
    early stop). ``tiled_gated_delta_net_layer`` avoids it by tiling the whole decoder layer,
    which is what ``apply_to_qwen3_5(tiled_gdn=N)`` does where the layer's MLP is per token.

    Dropout, autocast, RNG, frozen or trainable parameters, ``retain_graph`` and the second
    derivative's error: as ``tiled_mlp``. With dropout the masks are the tile's own draws, not
    the untiled module's (as with any change of batch shape), replayed exactly in backward.
    ``tile_tokens`` ≥ T: one tile, the module's math with grad, no recompute. Nothing requiring
    grad: tile by tile without grad (a long prefill without a cache in less memory).
    """
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
    # not stashed: the layer's recompute needs this node's output anyway (the passes above)
    return tiled_call(TiledGDNFunction, tiles, x, params, stash=False)


class _GatedDeltaNetLayerTile:
    """One tile of a GatedDeltaNet decoder layer: ``((h, m), carry) = tile(x, carry, span)`` with

        h, carry' = x + GatedDeltaNet_tile(input_layernorm(x), carry)      (``_GatedDeltaNetTile``)
        m         = mlp(post_attention_layernorm(h))

    the layer's output ``h + m`` given as its two addends (``Tiles``): what transformers'
    ``Qwen3_5DecoderLayer.forward`` computes for a linear-attention layer, on the tile's rows."""

    def __init__(self, layer: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict):
        self.layer = layer
        self.mixer = _GatedDeltaNetTile(layer.linear_attn, attention_mask, kwargs)
        # a tiled MLP's own forward: the layer's tile already bounds the MLP's working set, and an MLP
        # tiled again inside it would hide its down GEMM's output from _recompute_tile
        forward = vars(layer.mlp).get("forward")
        self.mlp = forward.untiled if isinstance(forward, TiledMLPForward) else layer.mlp

    def __call__(self, x: torch.Tensor, carry, span: tuple[int, int]):
        layer = self.layer
        mixed, carry = self.mixer(layer.input_layernorm(x), carry, span)
        h = x + mixed
        return (h, self.mlp(layer.post_attention_layernorm(h))), carry


class TiledGDNLayerFunction(TiledFunction):
    """The tiled GatedDeltaNet decoder layer's node: ``TiledFunction`` of ``_GatedDeltaNetLayerTile``,
    its carries hidden from a checkpoint around it (``tiled_call``); ``tiled_gated_delta_net_layer``."""

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
    """A GatedDeltaNet decoder layer's forward ``layer(x, attention_mask=...)`` computed
    ``tile_tokens`` positions at a time, the whole layer in each tile (``_GatedDeltaNetLayerTile``:
    input norm, the GatedDeltaNet's tile with its carry, residual, post-attention norm, MLP,
    residual): exactly the layer's function, with the backward's working set of one tile.

    Why the whole layer and not the GatedDeltaNet alone (``tiled_gated_delta_net``): under the
    decoder layer's gradient checkpoint, the checkpoint's recompute must rebuild what the layer's
    later ops save (the post-attention norm's and the MLP's inputs), which takes the
    GatedDeltaNet's output, which only a tile pass gives: three GatedDeltaNet forwards a step
    where the untiled layer runs two (measured +10.9% of the 9B step at 32k on the H200, 963ed32).
    Tiled as a whole, the layer saves its input first (``_StashInput``) and hides its carries from
    the checkpoint (``tiled_call``'s ``hide_saved``), so the checkpoint's recompute stops at the
    input: forward 1 (tiles, no grad), recompute 0, backward 1 forward (without the MLP's down
    GEMM, ``_recompute_tile``) and 1 backward per tile in reverse — the untiled checkpointed layer's
    passes. The carries, the fp32 delta-rule state and the conv's last K−1 input rows (2.05 MiB a
    tile at 9B), stay alive from the forward to the layer's backward: 24 layers × T / tile of them.
    An input that does not require grad (no stash) is kept by the node too, on the GPU even when
    the layer's checkpoint is offloaded.

    ``layer``: a decoder layer ``is_gated_delta_net_layer`` accepts, patched by q35lab or not;
    ``attention_mask``: the 2-D padding mask; ``kwargs``: the rest the layer would hand its
    GatedDeltaNet. Packed sequences are refused (``ValueError``); ``tile_tokens`` ≥ T runs the
    tile function once, with grad; nothing requiring grad: tile by tile without grad. Dropout, RNG,
    autocast, frozen or trainable parameters, ``retain_graph`` and the second derivative's error:
    as ``tiled_mlp``. Hooks on the layer's GatedDeltaNet or MLP are not called (its forward,
    ``TiledGDNLayerForward``, runs such a layer untiled)."""
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
    """A GatedDeltaNet's forward through ``tiled_gated_delta_net`` when it trains on more than a tile.

    Untiled (the wrapped forward, as the module computes it): no grad needed (eval, generation),
    ``T`` ≤ the tile, a call other than transformers' keyword one; and, with a warning (the memory
    the tiling would save is then spent), a cache (generation's prefill; a training forward
    without gradient checkpointing gets one unless ``use_cache=False``) or packed sequences
    (``cu_seq_lens_q``), whose state tiles cannot carry. Also untiled: a conv1d under accelerate's
    offload hooks (the tiles read its weight directly)."""

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
    """A GatedDeltaNet decoder layer's forward through ``tiled_gated_delta_net_layer`` when it
    trains on more than a tile; otherwise the wrapped forward, whose GatedDeltaNet (tiled by
    ``TiledGDNForward`` where it can be) says why it runs untiled. Also the wrapped forward: a
    layer whose GatedDeltaNet or MLP has hooks (or a global module hook is set), and one whose
    forward was wrapped before (accelerate's hooks)."""

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
            # transformers that checkpoints the class's forward (which this one replaces): as it would, through the
            # layer's checkpoint function (the offload's hooks wrap it); one that checkpoints __call__ has already
            return layer._gradient_checkpointing_func(tiled, x)
        return tiled(x)

    def _untiled(self, x, args: tuple, kwargs: dict) -> bool:
        if self.nothing_to_tile(x, args):
            return True
        layer = self.module
        gdn = layer.linear_attn
        return (has_cache(kwargs) or packed_arguments(kwargs) is not None or gated_delta_net_problem(gdn) is not None
                # hooks the tiles would not call (or would call per tile, on an uncomputed down output), and a
                # forward wrapped before the tiling (accelerate's device placement): the layer as it is
                or hooks_would_see(gdn, layer.mlp) or self.inner is not None
                or any(getattr(m, "_hf_hook", None) is not None for m in (layer, gdn.conv1d)))


def tile_gated_delta_net(gdn: torch.nn.Module, tile_tokens: int) -> bool:
    """Give a GatedDeltaNet a ``TiledGDNForward`` around its current forward; True if it had none
    (an existing one just takes the new tile size). Call after any patch that sets its forward
    (``apply_to_qwen3_5``'s conv), and ``untile_gated_delta_net`` before undoing that patch.
    ``TypeError`` (naming ``gdn``) for a module ``gated_delta_net_problem`` says cannot be tiled."""
    problem = gated_delta_net_problem(gdn)
    if problem:
        raise TypeError(f"gdn: cannot be tiled: {problem}")
    return put_tiled_forward(gdn, tile_tokens, TiledGDNForward)


def untile_gated_delta_net(gdn: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net`` wrapped; True if there was a tiled one."""
    return take_tiled_forward(gdn, TiledGDNForward)


def tile_gated_delta_nets(model: torch.nn.Module, tile_tokens: int) -> int:
    """``tile_gated_delta_net`` on every GatedDeltaNet of ``model`` that can be tiled, and
    ``tile_gated_delta_net_layer`` on every decoder layer of one with a per-token MLP (the tiled
    layer is what trains; the tiled GatedDeltaNet serves the layers that cannot be tiled whole);
    how many modules were new."""
    new = 0
    for m in model.modules():
        if is_gated_delta_net(m) and gated_delta_net_problem(m) is None:
            new += tile_gated_delta_net(m, tile_tokens)
        elif is_gated_delta_net_layer(m) and gated_delta_net_problem(m.linear_attn) is None:
            new += tile_gated_delta_net_layer(m, tile_tokens)
    return new


def untile_gated_delta_nets(model: torch.nn.Module) -> int:
    return sum(untile_gated_delta_net(m) or untile_gated_delta_net_layer(m) for m in model.modules())


def tile_gated_delta_net_layer(layer: torch.nn.Module, tile_tokens: int) -> bool:
    """Give a GatedDeltaNet decoder layer a ``TiledGDNLayerForward``; True if it had none.
    ``TypeError`` (naming ``layer``) for a module ``is_gated_delta_net_layer`` refuses."""
    _check_gated_delta_net_layer(layer)
    return put_tiled_forward(layer, tile_tokens, TiledGDNLayerForward)


def untile_gated_delta_net_layer(layer: torch.nn.Module) -> bool:
    """Put back the forward ``tile_gated_delta_net_layer`` wrapped; True if there was a tiled one."""
    return take_tiled_forward(layer, TiledGDNLayerForward)
