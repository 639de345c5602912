"""N linear projections of one input, each with an optional LoRA adapter, as one autograd node.

A GatedDeltaNet projects its input ``x`` four times (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``). Unfused, with PEFT, ``x`` is read (and cast) four times, four
adapter paths are saved, and autograd sums four ``dx`` contributions. Fused, with
``W = [W_1; …; W_n]`` (concatenated rows, ``ΣN × K``), ``A = [A_1; …; A_m]`` (``Σr × K``) over
the projections that have adapters::

    y    = x·Wᵀ (+ b)                          one GEMM; y_i are column slices of y
    xa   = d(x)·Aᵀ                              one GEMM, [T, Σr]
    y_i += s_i · xa_i·B_iᵀ                      in place, on each slice

Backward, each ``dy_i`` where autograd hands it over (no ``[T, ΣN]`` copy)::

    dxa_i = s_i · dy_i·B_i                      [T, r_i] each
    dx    = Σ_i dy_i·W_i + m/q ⊙ dxa·A          the adapters and the narrow projections in one
                                                thin GEMM, each wide projection accumulating
    dA_i  = dxa_iᵀ·d(x),   dB_i = s_i · dy_iᵀ·xa_i

FP8 bases (each projection's ``weight_scale`` given: an e4m3 weight, ``fp8.py``): ``W`` is the
concatenated FP8 weights with their scales, and each base GEMM above runs on FP8; having no
accumulating form, it writes its buffer first and the adapters' thin GEMM accumulates onto it.

Dropout: PEFT draws one mask per projection, so with dropout the adapter GEMMs run per projection
(each mask regenerated from its seed in backward). The frozen base weights' concatenation is
cached by ``ConcatCache`` until one of them changes (a new tensor or an in-place update); the
adapters change every step and are concatenated on every call (Σr·K values). ``pack_rows`` first
moves the base weights into one buffer, each its own row slice, so that the concatenation is a
view, not a second copy of every weight. Weights gathered anew each step (FSDP2's) are
concatenated at each call, the copy alive only until backward has used it
(``ConcatCache(keep_copies=False)``).

The outputs are column blocks of one ``[T, ΣN]`` buffer ``y``, handed out as tensors of their own
over its memory (``set_``), not as views: autograd forbids in-place edits of views made inside a
Function, and separate ``nn.Linear`` outputs allow them. That is sound because the blocks are
disjoint and the backward never reads ``y``; each output keeps its own version counter. A block
is strided (its rows lie ``ΣN`` apart), so a ``reshape`` across its rows copies it: a projection
named in ``own_buffer`` (the GatedDeltaNet's ``z``, reshaped for its norm) gets a contiguous
buffer of its own, the base GEMM split at its columns (one GEMM per buffer, each over a row
block of ``W``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_same_device
from ._compile import opaque_to_compile
from ._linear import (
    cast_factor,
    check_dropout,
    check_scaling,
    compute_dtype,
    dropout_mask,
    dropped,
    row_count,
    scaled_b,
    scaled_product,
)
from ._prepared import prepared
from .fp8 import FP8_DTYPE, check_fp8_weight, dequantize_weight, fp8_input_grad, fp8_matmul

__all__ = ["Projection", "ConcatCache", "pack_rows", "unpack_rows", "fused_lora_projections",
           "fused_lora_projections_ref"]


@dataclass
class Projection:
    """One projection of the shared input: ``x·Wᵀ + b + scaling · dropout(x)·Aᵀ·Bᵀ``.

    Args:
        weight (Tensor): ``[N, K]``, frozen.
        bias (Tensor, optional): ``[N]``, frozen. Default: None.
        lora_A (Tensor, optional): ``[r, K]``, with ``lora_B``. Default: None (no adapter).
        lora_B (Tensor, optional): ``[N, r]``. Default: None.
        scaling (float): the adapter scale, a finite real number. Default: 1.
        dropout (float): the adapter input's dropout probability, in [0, 1). Default: 0.
        weight_scale (Tensor, optional): ``[N]`` fp32: ``weight`` is an FP8 (e4m3) base with these
            per-output-channel scales (``q35lab.ops.fp8.quantize_weight``). Default: None.

    Raises:
        TypeError: ``scaling`` or ``dropout`` not a real number (a bool, a string or a tensor).
        ValueError: ``scaling`` not finite, ``dropout`` outside [0, 1). The tensors are checked by
            ``fused_lora_projections``, whose errors name ``projections[i].<field>``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 1.0
    dropout: float = 0.0
    weight_scale: torch.Tensor | None = None

    def __post_init__(self):
        check_scaling("scaling", self.scaling)
        check_dropout("dropout", self.dropout)

    @property
    def has_adapter(self) -> bool:
        return self.lora_A is not None


def pack_rows(weights: list[torch.Tensor]) -> bool:
    """Move ``weights`` (``[N_i, K]`` each) into one ``[ΣN, K]`` buffer, in place: each tensor's
    ``.data`` becomes its row slice (contiguous), the values and the Parameter objects unchanged.

    Returns False, changing nothing, when they cannot share a buffer (dtypes, devices or widths
    that differ, meta or subclassed tensors such as quantized weights)."""
    first = weights[0]
    if any(type(w) not in (torch.Tensor, torch.nn.Parameter) or w.is_meta or w.dim() != 2
           or w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1]
           for w in weights):
        return False
    packed = torch.cat([w.detach() for w in weights])
    start = 0
    for w in weights:
        w.data = packed[start:start + w.shape[0]]
        start += w.shape[0]
    return True


def unpack_rows(weights: list[torch.Tensor]) -> None:
    """Undo ``pack_rows``: each weight gets a buffer of its own again (same values)."""
    for w in weights:
        w.data = w.data.clone()


def rows_of_one_buffer(weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """The ``[ΣN, K]`` view spanning ``weights`` (already checked to be ``[N_i, K]``) when they lie
    back to back in one buffer, in ``dtype`` (as ``pack_rows`` leaves them); None otherwise."""
    first = weights[0]
    end = first.data_ptr()
    for w in weights:
        if (w.dtype != dtype or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.data_ptr() != end):
            return None
        end += w.numel() * w.element_size()
    return first.detach().as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


class ConcatCache:
    """The concatenated base weights (and biases) of a group, rebuilt only when they change; a view,
    not a copy, when the weights already lie back to back in one buffer (``pack_rows``).

    ``keep_copies=False``: a concatenation made by copy is held only weakly, alive while autograd
    keeps it for backward (or a caller holds it) and made again once it is freed. For weights that
    are not one buffer because they are gathered anew each step (FSDP2's unsharded parameters, freed
    after each layer's forward and backward), a copy kept between steps would hold every layer's
    weights whole on every rank."""

    def __init__(self, keep_copies: bool = True):
        self.keep_copies = keep_copies
        self._key = None
        self._value = None  # (weight or a weak reference to a copied weight, bias)

    def get(self, projections: list[Projection], dtype: torch.dtype):
        """``(weight, bias)``: the concatenation in ``dtype`` (FP8 weights stay FP8)."""
        return self.get_scaled(projections, dtype)[:2]

    def get_scaled(self, projections: list[Projection], dtype: torch.dtype):
        """``(weight, bias, scale)``: ``get``'s and, for FP8 weights, their concatenated scales (else None)."""
        scales = [p.weight_scale for p in projections if p.weight_scale is not None]
        tensors = ([p.weight for p in projections] + [p.bias for p in projections if p.bias is not None]
                   + scales)
        key = (dtype, tuple((id(t), t._version, t.data_ptr()) for t in tensors))
        if key == self._key:
            weight, bias, scale = self._value
            weight = weight() if isinstance(weight, weakref.ref) else weight
            if weight is not None:
                return weight, bias, scale
        weight_dtype = FP8_DTYPE if scales else dtype  # an FP8 weight is read as stored, never cast
        weight = rows_of_one_buffer([p.weight for p in projections], weight_dtype)
        copied = weight is None
        if copied:
            weight = torch.cat([p.weight.detach().to(weight_dtype) for p in projections], dim=0)
        scale = torch.cat(scales) if scales else None  # ΣN values: always kept
        bias = None
        if any(p.bias is not None for p in projections):  # ΣN values: always kept
            bias = torch.cat([(p.bias.detach() if p.bias is not None
                               else torch.zeros(p.weight.shape[0], device=weight.device)).to(dtype)
                              for p in projections])
        self._key = key
        self._value = (weakref.ref(weight) if copied and not self.keep_copies else weight, bias, scale)
        return weight, bias, scale


def fused_lora_projections_ref(x: torch.Tensor, projections: list[Projection], seeds=None) -> tuple[torch.Tensor, ...]:
    """The unfused computation (PEFT's, in ``x.dtype``), for tests and the notebook."""
    from .lora import lora_linear_ref

    outs = []
    for i, p in enumerate(projections):
        weight = p.weight if p.weight_scale is None else dequantize_weight(p.weight, p.weight_scale, x.dtype)
        if p.has_adapter:
            seed = 0 if seeds is None else seeds[i]
            outs.append(lora_linear_ref(x, weight, p.lora_A, p.lora_B, p.scaling, p.bias, p.dropout, seed))
        else:
            bias = None if p.bias is None else p.bias.to(x.dtype)
            outs.append(torch.nn.functional.linear(x, weight.to(x.dtype), bias))
    return tuple(outs)


class FusedLoRAProjectionsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_cat, bias_cat, scale_cat, meta, *adapters):
        """meta: (out_features per projection, [(index, scaling, dropout, seed)] per adapter,
        [(first, stop)] projection ranges that share one output buffer)."""
        out_features, lora_meta, buffers = meta
        dtype = x.dtype
        x2d = x.reshape(row_count(x), x.shape[-1])
        offsets = [0]
        for n in out_features:
            offsets.append(offsets[-1] + n)
        A_list, B_list = adapters[0::2], adapters[1::2]
        if lora_meta:
            shared_input = all(dropout == 0.0 for _, _, dropout, _ in lora_meta)
            if shared_input:  # one GEMM for every adapter's A
                a_rows = prepared(lambda: torch.cat([cast_factor(a, dtype) for a in A_list]), "A rows", dtype, *A_list)
                xa = x2d @ a_rows.t()
            else:
                xa = torch.cat([dropped(x2d, dropout, seed) @ cast_factor(a, dtype).t()
                                for a, (_, _, dropout, seed) in zip(A_list, lora_meta)], dim=1)
            # every adapter's s·xa_i·B_iᵀ against one block-diagonal [ΣN, Σr] matrix (_projected)
            placement = tuple(offsets) + tuple((index, scaling) for index, scaling, _, _ in lora_meta)
            b_block = prepared(lambda: _block_diagonal_b(lora_meta, B_list, offsets, dtype, x2d.device), "B block",
                               dtype, placement, *B_list)
        else:
            xa, b_block = x2d.new_empty(0), None
        outputs = []
        for first, stop in buffers:  # one GEMM per output buffer, over its row block of W
            start, end = offsets[first], offsets[stop]
            bias = None if bias_cat is None else bias_cat[start:end]
            scale = None if scale_cat is None else scale_cat[start:end]
            y = _projected(x2d, weight_cat[start:end], bias, xa, b_block if b_block is None else b_block[start:end],
                           scale)
            outputs += [_column_block(y, offsets[i] - start, offsets[i + 1] - start, x.shape[:-1])
                        for i in range(first, stop)]
        # the scales only where there are some: saved_tensors holds no None for callers that inspect it
        ctx.save_for_backward(x2d, weight_cat, xa, *adapters, *(() if scale_cat is None else (scale_cat,)))
        ctx.fp8 = scale_cat is not None
        ctx.meta, ctx.offsets, ctx.x_shape = meta, offsets, x.shape
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no GEMM on zeros
        return tuple(outputs)

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        x2d, weight_cat, xa, *adapters = ctx.saved_tensors
        scale_cat = adapters.pop() if ctx.fp8 else None
        out_features, lora_meta, _ = ctx.meta
        offsets, dtype = ctx.offsets, x2d.dtype
        T = x2d.shape[0]
        # Each output's gradient is used as autograd hands it over: gathering them into one
        # [T, ΣN] buffer for a single dy·W GEMM would copy ΣN·T values.
        dys = [None if g is None else g.reshape(T, n).to(dtype) for g, n in zip(grads, out_features)]
        weights = [weight_cat[offsets[i]:offsets[i + 1]] for i in range(len(out_features))]
        scales = None if scale_cat is None else [scale_cat[offsets[i]:offsets[i + 1]] for i in range(len(out_features))]
        A_list, B_list = adapters[0::2], adapters[1::2]
        xa_list = torch.split(xa, [a.shape[0] for a in A_list], dim=1) if lora_meta else []
        dxa_list = [None if dys[i] is None else dys[i] @ scaled_b(b, s, dtype)  # s_i · dy_i·B_i
                    for (i, s, _, _), b in zip(lora_meta, B_list)]
        dx = _input_gradient(x2d, dys, weights, lora_meta, A_list, dxa_list, scales)
        adapter_grads = []
        for (i, s, dropout, seed), a, b, xa_i, dxa_i in zip(lora_meta, A_list, B_list, xa_list, dxa_list):
            if dxa_i is None:  # output i was not used: its adapter's gradient is zero
                adapter_grads += [torch.zeros_like(a), torch.zeros_like(b)]
                continue
            dA = (dxa_i.t() @ dropped(x2d, dropout, seed)).to(a.dtype)
            dB = scaled_product(dys[i].t(), xa_i, s).to(b.dtype)
            adapter_grads += [dA, dB]
        dx = dx.view(ctx.x_shape)
        return (dx, None, None, None, None, *adapter_grads)


#: Projections at most this wide (in_proj_b and in_proj_a: 32) join the adapters' thin GEMM in
#: backward: a dy_i·W_i GEMM of their own would read and rewrite all of dx for a few FLOPs.
NARROW_FEATURES = 256


def _input_gradient(x2d, dys, weights, lora_meta, A_list, dxa_list, scales=None) -> torch.Tensor:
    """``dx = Σ_i dy_i·W_i + Σ_j (dxa_j·A_j) ⊙ m_j/q_j`` in as few passes over ``dx`` as possible.

    One GEMM with a thin inner dimension writes dx first — every adapter's ``dxa_j·A_j`` (no
    dropout) and every narrow projection's ``dy_i·W_i``, concatenated along the inner dimension
    (``[T, Σr + Σn_narrow]``: thin); adapters with dropout add their masked term;
    then each wide projection's GEMM accumulates onto dx (β = 1, in its compute-bound epilogue).

    FP8 weights (``scales``): the wide projections' FP8 GEMMs, which cannot accumulate, come first
    (the second and later added), and the thin GEMM accumulates onto them; a narrow projection
    joins it with its weight dequantized (at most ``NARROW_FEATURES`` rows).
    """
    if scales is not None:
        return _fp8_input_gradient(x2d, dys, weights, lora_meta, A_list, dxa_list, scales)
    dtype = x2d.dtype
    thin, masked = _adapter_terms(lora_meta, A_list, dxa_list, dtype)
    wide = []  # (dy, W)
    for dy, w in zip(dys, weights):
        if dy is None:
            continue
        if w.shape[0] <= NARROW_FEATURES:
            thin.append((dy, w))
        else:
            wide.append((dy, w))
    dx = None
    if thin:
        lefts, rights = zip(*thin)
        dx = torch.cat(lefts, dim=1) @ prepared(lambda: torch.cat(rights), "rows", *rights)
    dx = _add_masked(dx, x2d, masked)
    for dy, w in wide:
        dx = dy @ w if dx is None else dx.addmm_(dy, w)
    return x2d.new_zeros(x2d.shape) if dx is None else dx


def _fp8_input_gradient(x2d, dys, weights, lora_meta, A_list, dxa_list, scales) -> torch.Tensor:
    dtype = x2d.dtype
    dx = None
    thin = []
    for dy, w, s in zip(dys, weights, scales):
        if dy is None:
            continue
        if w.shape[0] <= NARROW_FEATURES:
            thin.append((dy, dequantize_weight(w, s, dtype)))
        else:
            part = fp8_input_grad(dy, w, s)
            dx = part if dx is None else dx.add_(part)
    adapter_thin, masked = _adapter_terms(lora_meta, A_list, dxa_list, dtype)
    thin += adapter_thin
    if thin:
        lefts, rights = zip(*thin)
        left, right = torch.cat(lefts, dim=1), torch.cat(rights)
        dx = left @ right if dx is None else dx.addmm_(left, right)
    dx = _add_masked(dx, x2d, masked)
    return x2d.new_zeros(x2d.shape) if dx is None else dx


def _adapter_terms(lora_meta, A_list, dxa_list, dtype) -> tuple[list, list]:
    """The adapters' shares of dx: ``(thin, masked)``, the (dxa, A) factors of those without dropout
    (joined into one thin GEMM) and the (dxa, A, p, seed) of those with it (each masked alone)."""
    thin, masked = [], []
    for (_, _, dropout, seed), a, dxa in zip(lora_meta, A_list, dxa_list):
        if dxa is None:
            continue
        if dropout:
            masked.append((dxa, a, dropout, seed))
        else:
            thin.append((dxa, cast_factor(a, dtype)))
    return thin, masked


def _add_masked(dx, x2d, masked):
    """``dx`` plus each dropout adapter's share, its forward mask regenerated from the seed."""
    for dxa, a, dropout, seed in masked:
        lora_dx = (dxa @ cast_factor(a, x2d.dtype)).mul_(dropout_mask(x2d, dropout, seed)).div_(1.0 - dropout)
        dx = lora_dx if dx is None else dx.add_(lora_dx)
    return dx


def _projected(x2d, weight, bias, xa, b_block, scale=None) -> torch.Tensor:
    """``x·Wᵀ (+ bias) + xa·B̂ᵀ`` for one output buffer: the adapters' thin GEMM (against the
    block-diagonal ``B̂``) written first, the base GEMM accumulating onto it (β = 1, read in its
    compute-bound epilogue) instead of a memory-bound ``y[:, slice] += …`` per adapter. An FP8
    base (``scale``) writes the buffer first and the thin GEMM accumulates onto it."""
    if scale is not None:
        y = fp8_matmul(x2d, weight, scale, bias)
        return y if b_block is None else y.addmm_(xa, b_block.t())
    if b_block is None:
        return x2d @ weight.t() if bias is None else torch.addmm(bias, x2d, weight.t())
    y = xa @ b_block.t() if bias is None else torch.addmm(bias, xa, b_block.t())
    return y.addmm_(x2d, weight.t())


def _output_buffers(count: int, own_buffer) -> tuple[tuple[int, int], ...]:
    """Ranges ``(first, stop)`` of projections whose outputs share one buffer: each projection in
    ``own_buffer`` alone, the others in runs of neighbours."""
    ranges, first = [], 0
    for i in range(count):
        if i in own_buffer:
            if first < i:
                ranges.append((first, i))
            ranges.append((i, i + 1))
            first = i + 1
    if first < count:
        ranges.append((first, count))
    return tuple(ranges)


def _block_diagonal_b(lora_meta, B_list, offsets, dtype, device) -> torch.Tensor:
    """``[N, Σr]``: adapter i's ``s_i·B_i`` in its projection's rows and its own rank columns."""
    ranks = [b.shape[1] for b in B_list]
    block = torch.zeros(offsets[-1], sum(ranks), dtype=dtype, device=device)
    col = 0
    for (index, scaling, _, _), b, r in zip(lora_meta, B_list, ranks):
        block[offsets[index]:offsets[index + 1], col:col + r] = (b * scaling).to(dtype)
        col += r
    return block


def _column_block(y: torch.Tensor, start: int, stop: int, lead: torch.Size) -> torch.Tensor:
    """Columns ``start:stop`` of ``y`` (``[T, ΣN]``) as a ``[*lead, stop − start]`` tensor over the
    same memory (no copy) that is not a view to autograd, so the caller may edit it in place."""
    block = y[:, start:stop].view(*lead, stop - start)
    return y.new_empty(0).set_(y.untyped_storage(), block.storage_offset(), block.shape, block.stride())


def _check_own_buffer(own_buffer: object, count: int) -> frozenset[int]:
    try:
        indices = list(own_buffer)
    except TypeError:
        raise TypeError(f"own_buffer: expected projection indices (ints), got {type(own_buffer).__name__}") from None
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise ValueError(f"own_buffer: expected indices of the {count} projections (0 to {count - 1}), got {i!r}")
    return frozenset(indices)


def _check_tensor_field(name: str, value: object, shape: tuple[int, ...]) -> None:
    """A bf16/fp16/fp32 tensor of ``shape`` (``TypeError`` / ``ValueError`` naming it else)."""
    check_float_tensor(name, value)
    if tuple(value.shape) != shape:
        expected = ", ".join(map(str, shape))
        raise ValueError(f"{name}: expected [{expected}], got {tuple(value.shape)}")


def _check_projection(i: int, p: object, K: int) -> None:
    """Every field of ``projections[i]`` (shapes against in_features ``K``), named in the error."""
    name = f"projections[{i}]"
    if not isinstance(p, Projection):
        raise TypeError(f"{name}: expected a q35lab Projection, got {type(p).__name__}")
    if p.weight_scale is not None:
        check_fp8_weight(f"{name}.weight", p.weight, p.weight_scale, K)
    else:
        check_float_tensor(f"{name}.weight", p.weight)
    if p.weight.dim() != 2 or p.weight.shape[1] != K:
        raise ValueError(f"{name}.weight: expected [N, {K}] (K = last dimension of x), got {tuple(p.weight.shape)}")
    N = p.weight.shape[0]
    if p.bias is not None:
        _check_tensor_field(f"{name}.bias", p.bias, (N,))
    if p.weight.requires_grad or (p.bias is not None and p.bias.requires_grad):
        raise ValueError(f"{name}: the base weight and bias must be frozen (LoRA); "
                         "a trainable base projection is not fused")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"{name}: lora_A and lora_B must be given together")
    if p.has_adapter:
        check_float_tensor(f"{name}.lora_A", p.lora_A)
        if p.lora_A.dim() != 2 or p.lora_A.shape[1] != K:
            raise ValueError(f"{name}.lora_A: expected [r, {K}], got {tuple(p.lora_A.shape)}")
        _check_tensor_field(f"{name}.lora_B", p.lora_B, (N, p.lora_A.shape[0]))
    check_scaling(f"{name}.scaling", p.scaling)
    check_dropout(f"{name}.dropout", p.dropout)


@opaque_to_compile  # a graph break under torch.compile (see _compile.py)
def fused_lora_projections(x: torch.Tensor, projections, *, cache: ConcatCache | None = None,
                           own_buffer=()) -> tuple[torch.Tensor, ...]:
    """All ``projections`` of ``x`` as one autograd node: ``x·W_iᵀ + b_i + s_i · d(x)·A_iᵀ·B_iᵀ`` for each.

    Args:
        x (Tensor): ``[..., K]``; bf16, fp16 or fp32 (cast to the autocast dtype under autocast,
            as ``F.linear`` would).
        projections (iterable of Projection): sharing ``x``, adapters optional and mixed freely;
            each field is checked as ``lora_linear`` checks its argument of that name.
        cache (ConcatCache, optional): keeps the concatenated base weights between calls.
            Default: None (concatenated anew).
        own_buffer (iterable of int): indices of projections whose output gets a contiguous buffer
            of its own, for a consumer that reshapes it across rows. Default: none.

    Returns:
        tuple of Tensor: one ``[..., N_i]`` output per projection. The others are column blocks of
        one shared buffer (strided, no copies); none is a view, so each may be edited in place like
        a separate ``nn.Linear``'s output. Any size may be zero.

    Raises:
        TypeError: ``x`` or a field not of the expected type (errors name ``projections[i].<field>``),
            ``cache`` not a ``ConcatCache``, ``own_buffer`` not indices.
        ValueError: no projections, shapes that do not match, a trainable base weight, tensors on
            different devices, an index of ``own_buffer`` out of range, FP8 and float base weights mixed.
    """
    check_float_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected [..., K] (at least one dimension), got a 0-dimensional tensor")
    if cache is not None and not isinstance(cache, ConcatCache):
        raise TypeError(f"cache: expected a ConcatCache or None, got {type(cache).__name__}")
    try:
        projections = list(projections)
    except TypeError:
        raise TypeError(f"projections: expected a list of Projection, got {type(projections).__name__}") from None
    if not projections:
        raise ValueError("projections: expected at least one Projection")
    K = x.shape[-1]
    for i, p in enumerate(projections):
        _check_projection(i, p, K)
    if len({p.weight_scale is None for p in projections}) > 1:
        raise ValueError("projections: expected every base weight FP8 (weight_scale given) or none; got a mix")
    own_buffer = _check_own_buffer(own_buffer, len(projections))
    check_same_device(x=x, **{f"projections[{i}].{field}": t for i, p in enumerate(projections)
                              for field in ("weight", "bias", "lora_A", "lora_B", "weight_scale")
                              if (t := getattr(p, field)) is not None})
    adapters, lora_meta = [], []
    for i, p in enumerate(projections):
        if p.has_adapter:
            dropout = float(p.dropout)
            seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout else 0
            adapters += [p.lora_A, p.lora_B]
            lora_meta.append((i, float(p.scaling), dropout, seed))
    dtype = compute_dtype(x)
    weight_cat, bias_cat, scale_cat = (cache or ConcatCache()).get_scaled(projections, dtype)
    meta = (tuple(p.weight.shape[0] for p in projections), tuple(lora_meta),
            _output_buffers(len(projections), own_buffer))
    with torch.autocast(device_type=x.device.type, enabled=False):
        return FusedLoRAProjectionsFunction.apply(x.to(dtype), weight_cat, bias_cat, scale_cat, meta, *adapters)
