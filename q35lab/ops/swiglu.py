"""SwiGLU, the activation of every Qwen3.5 MLP: ``h = silu(g) · u``.

transformers' ``Qwen3_5MLP`` computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with
``act_fn = silu``; this op is the middle of that line, per element of ``g = gate_proj(x)`` and
``u = up_proj(x)`` (width I = 12288 in the 9B model, 17408 in the 27B)::

    s = σ(g) = 1 / (1 + e^-g)        # fp32
    a = silu(g) = g · s
    h = a · u

Two rounding modes, as for the gated norm:

* ``rounding="hf"`` reproduces transformers: ``silu(g)`` is rounded to the input dtype (torch's
  silu computes ``g / (1 + e^-g)`` in fp32 and rounds), then the product is rounded again;
* ``rounding="fused"`` keeps fp32 to the end and rounds once.

Backward (both modes: the exact fp32 gradient of the formula, one rounding per store)::

    dg = dh · u · s · (1 + g · (1 − s))
    du = dh · a

Memory. The node saves only its inputs ``g`` and ``u`` (their producers, the gate and up
projections, made them; the output ``h`` is saved by the down projection as its input, not
here). ``g`` and ``u`` are dead once this backward has run, so the backward writes ``dg`` and
``du`` over them and allocates nothing (as Liger does) — but only when that is safe, decided per
call (``_may_overwrite``): the graph is not being retained (``retain_graph``/``create_graph``
keep it, and a second backward must read the activations again), the tensor is not a leaf or a
view, and nothing but this node references it or its memory (no Python variable, no other
autograd node's saved tensor, no alias) — except the other input, when ``g`` and ``u`` are the
two halves of one fused gate/up output, side by side in one buffer: each element's gradients
then go where its inputs were read, so the two blocks are written over together. Otherwise the
gradients get fresh buffers, and the inputs are never touched.

Layout. Inputs are read with their own row stride, so the column slices of one ``[T, 2I]``
buffer (gate and up projections fused into one GEMM) are used without copies.
``swiglu_packed(gate_up)`` takes that buffer whole (gate = first half, up = second half) and
returns ONE ``[.., 2I]`` gradient, so the fused GEMM's backward gets one contiguous ``dy`` —
written over the saved buffer itself when safe.

Kernels: tiles of ``BLOCK_ROWS × BLOCK_COLS`` = 4096 elements, one a program, column blocks
fastest: rows of 12288 or 17408 are split across programs, narrow rows are stacked into one.

Layering: ``_swiglu_fwd_kernel`` / ``_swiglu_bwd_kernel`` (Triton) → ``swiglu_fwd`` /
``swiglu_bwd`` (host) → ``SwiGLUFunction`` / ``SwiGLUPackedFunction`` → ``swiglu`` /
``swiglu_packed`` (functional); ``swiglu_ref`` is the PyTorch reference every test compares to.
No module: the MLP that calls it (``down(swiglu(gate(x), up(x)))``) belongs to the patch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_kernel_device, check_like
from ._compile import opaque_to_compile
from ._tuned import tuned_config
from .lora import _check_projection_args, _check_scaling, _input_grad, _project_into, _scaled_product

__all__ = [
    "ROUNDINGS",
    "swiglu_ref",
    "swiglu_packed_ref",
    "LaunchConfig",
    "launch_config",
    "swiglu_fwd",
    "swiglu_bwd",
    "SwiGLUFunction",
    "SwiGLUPackedFunction",
    "swiglu",
    "swiglu_packed",
]

ROUNDINGS = ("hf", "fused")


# --------------------------------------------------------------------------------------------
# References: transformers' act_fn(gate) * up ("hf") and the once-rounded product ("fused").
# --------------------------------------------------------------------------------------------
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, rounding: str = "hf") -> torch.Tensor:
    """The PyTorch reference of both modes; with fp64 inputs, the exact answer.

    ``"hf"`` is transformers' ``Qwen3_5MLP`` line, ``act_fn(gate_proj(x)) * up_proj(x)``:
    ``silu`` rounds to the input dtype, and so does the product.
    """
    if rounding == "hf":
        return torch.nn.functional.silu(gate) * up
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (torch.nn.functional.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def swiglu_packed_ref(gate_up: torch.Tensor, rounding: str = "hf") -> torch.Tensor:
    """``swiglu_ref`` of the two halves of ``gate_up`` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_ref(gate, up, rounding)


# --------------------------------------------------------------------------------------------
# Kernels. One program = one tile of BLOCK_ROWS rows × BLOCK_COLS columns.
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """The tile's first row, as int64 (row·stride passes 2³¹ at 128k tokens × 2I), then its
    rows relative to that one, its columns and its mask: int32 offsets within one tile (the
    host keeps BLOCK_ROWS·stride below 2³¹).

    A 1-D grid, column blocks fastest: programs launched together stream through consecutive
    memory, as a copy does (a 2-D grid with rows on axis 0 sent them to the same columns of
    different rows: 2.5-3.5 % slower on the H200)."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_COLS)
    row0 = (pid // col_blocks).to(tl.int64) * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)[:, None]
    cols = ((pid % col_blocks) * BLOCK_COLS + tl.arange(0, BLOCK_COLS))[None, :]
    mask = (rows < (n_rows - row0).to(tl.int32)) & (cols < n_cols)
    return row0, rows, cols, mask


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """Load and upcast to fp32; EVEN (the tiles cover the matrix exactly) drops the mask."""
    if EVEN:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptrs, value, mask, EVEN: tl.constexpr):
    """Round once to the destination's dtype and store."""
    if EVEN:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_value(g, u, H, HF_ROUNDING: tl.constexpr):
    """``silu(g)·u`` in fp32 from fp32 ``g`` and ``u``, before the store's rounding to the dtype of
    the output pointer ``H``. One function for the forward and for the backward that rebuilds
    ``h``: the same bits."""
    if HF_ROUNDING:
        # torch's silu is g / (1 + e^-g) with an IEEE division, rounded to the input dtype;
        # the product of two 16-bit tensors is then rounded again.
        a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(H.dtype.element_ty).to(tl.float32)
        return a * u
    else:
        return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_fwd_kernel(
    G,  # [n_rows, n_cols] gate, row stride stride_g, unit column stride
    U,  # [n_rows, n_cols] up
    H,  # [n_rows, n_cols] output, gate's dtype
    n_rows,
    n_cols,
    stride_g,
    stride_u,
    stride_h,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
):
    row0, rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    g = _load(G + row0 * stride_g + (rows * stride_g + cols), mask, EVEN)
    u = _load(U + row0 * stride_u + (rows * stride_u + cols), mask, EVEN)
    h = _swiglu_value(g, u, H, HF_ROUNDING)
    _store(H + row0 * stride_h + (rows * stride_h + cols), h, mask, EVEN)


@triton.jit
def _swiglu_bwd_kernel(
    DH,  # [n_rows, n_cols] upstream gradient
    G,  # [n_rows, n_cols] saved gate
    U,  # [n_rows, n_cols] saved up
    DG,  # [n_rows, n_cols] gate gradient; may be G itself (written over in place)
    DU,  # [n_rows, n_cols] up gradient; may be U itself
    H,  # [n_rows, n_cols] the forward's output rebuilt (STORE_H); may be DH itself
    n_rows,
    n_cols,
    stride_dh,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    stride_h,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EVEN: tl.constexpr,
    NEED_DG: tl.constexpr,
    NEED_DU: tl.constexpr,
    STORE_H: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
):
    """In place is safe: every element is loaded and stored by the same program, loads first.
    STORE_H writes ``h = silu(g)·u`` as the forward did (for a consumer's weight gradient that
    would otherwise have kept ``h`` from the forward)."""
    row0, rows, cols, mask = _tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    dh = _load(DH + row0 * stride_dh + (rows * stride_dh + cols), mask, EVEN)
    g = _load(G + row0 * stride_g + (rows * stride_g + cols), mask, EVEN)
    s = tl.sigmoid(g)
    # every branch is a compile-time one (constexpr flags), each reading u at most once
    if NEED_DG:
        u = _load(U + row0 * stride_u + (rows * stride_u + cols), mask, EVEN)
        _store(DG + row0 * stride_dg + (rows * stride_dg + cols), dh * u * s * (1.0 + g * (1.0 - s)), mask, EVEN)
        if STORE_H:
            _store(H + row0 * stride_h + (rows * stride_h + cols), _swiglu_value(g, u, H, HF_ROUNDING), mask, EVEN)
    else:
        if STORE_H:
            u = _load(U + row0 * stride_u + (rows * stride_u + cols), mask, EVEN)
            _store(H + row0 * stride_h + (rows * stride_h + cols), _swiglu_value(g, u, H, HF_ROUNDING), mask, EVEN)
    if NEED_DU:  # (u's memory may take du: it was read above where needed)
        _store(DU + row0 * stride_du + (rows * stride_du + cols), dh * (g * s), mask, EVEN)


# --------------------------------------------------------------------------------------------
# Launch configuration (ops/tuned.json may hold a GPU's measured one, keyed by width).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    block_rows: int  # rows per tile (power of two)
    block_cols: int  # columns per tile (power of two)
    fwd_warps: int
    bwd_warps: int


#: Elements per tile: 4096 bf16 elements = 8 KB per tensor per program.
_TILE = 4096
#: Narrowest column block: below it, lanes are masked off rather than laid out as tiny vectors.
_MIN_COLS = 16


@functools.lru_cache(maxsize=64)  # host time matters at small T: decide once per width
def launch_config(width: int) -> LaunchConfig:
    """The tile and warps used for rows of ``width``: this GPU's ``tuned.json`` entry over the
    default's other fields, else the default. A tuning script passes ``config=`` instead."""
    return tuned_config("swiglu", width, _default_config(width))


def _default_config(width: int) -> LaunchConfig:
    """Tiles of 4096 elements, 8 warps (16 values a thread per tensor: two 16-byte loads in
    bf16). Wide rows: column blocks of 2048 or 1024, whichever pads the row less (12288 →
    2 rows × 2048, 17408 and 5120 → 4 rows × 1024: no padding). Narrow rows: one column block,
    rows stacked. Measured on the H200 (T = 32k, copy 4.2 TB/s): "hf" forward 4.34 TB/s,
    "fused" 4.35-4.38, backward 4.29-4.31 at 12288 and 17408 — within 1 % of the best of the
    tiles tried; more values a thread cost up to half the "hf" forward (its IEEE division is
    long), and masked half-blocks (17408 in blocks of 2048) 3-6 %."""
    if width > 1024:
        block_cols = min((2048, 1024), key=lambda b: (_padding(width, b), -b))
    else:
        block_cols = max(_MIN_COLS, triton.next_power_of_2(max(width, 1)))
    return LaunchConfig(block_rows=max(1, _TILE // block_cols), block_cols=block_cols, fwd_warps=8, bwd_warps=8)


def _padding(width: int, block: int) -> float:
    return (triton.cdiv(width, block) * block - width) / width


# --------------------------------------------------------------------------------------------
# Host functions: [rows, width] matrices with unit column stride (any row stride) in.
# --------------------------------------------------------------------------------------------
def _fit(config: LaunchConfig | None, n_cols: int, *matrices: torch.Tensor) -> LaunchConfig:
    """``config`` (default: ``launch_config``), checked, with one-row tiles where a tile's
    int32 offsets (``BLOCK_ROWS · row stride``) would pass 2³¹ (narrow slices of huge rows)."""
    config = launch_config(n_cols) if config is None else config
    for name in ("block_rows", "block_cols"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"config.{name}: expected a power of two, got {value}")
    if config.block_rows > 1 and config.block_rows * max(m.stride(0) for m in matrices) >= 2**31:
        config = dataclasses.replace(config, block_rows=1)
    return config


def _even(n_rows: int, n_cols: int, config: LaunchConfig) -> bool:
    """Whether the tiles cover the matrix exactly (12288 or 17408 wide, rows a multiple of the
    tile's): the kernels then need no mask."""
    return n_rows % config.block_rows == 0 and n_cols % config.block_cols == 0


def _grid(n_rows: int, n_cols: int, config: LaunchConfig) -> tuple[int]:
    programs = triton.cdiv(n_rows, config.block_rows) * triton.cdiv(n_cols, config.block_cols)
    if programs >= 2**31:
        raise ValueError(f"{n_rows} rows of {n_cols}: more than 2³¹ tiles of {config.block_rows}×{config.block_cols}")
    return (programs,)


def swiglu_fwd(
    g2d: torch.Tensor, u2d: torch.Tensor, rounding: str = "hf", *, out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """``silu(g)·u`` over ``[rows, width]`` matrices; into ``out`` (any row stride) if given."""
    n_rows, n_cols = g2d.shape
    h = torch.empty_like(g2d, memory_format=torch.contiguous_format) if out is None else out
    if n_rows == 0 or n_cols == 0:
        return h
    config = _fit(config, n_cols, g2d, u2d, h)
    _swiglu_fwd_kernel[_grid(n_rows, n_cols, config)](
        g2d, u2d, h, n_rows, n_cols, g2d.stride(0), u2d.stride(0), h.stride(0),
        BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, EVEN=_even(n_rows, n_cols, config),
        HF_ROUNDING=rounding == "hf", num_warps=config.fwd_warps,
    )
    return h


def swiglu_bwd(
    dh2d: torch.Tensor, g2d: torch.Tensor, u2d: torch.Tensor, *, need_dg: bool = True, need_du: bool = True,
    dg: torch.Tensor | None = None, du: torch.Tensor | None = None, config: LaunchConfig | None = None,
    h_out: torch.Tensor | None = None, rounding: str = "hf",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dg, du)`` over ``[rows, width]`` matrices (``None`` where not needed).

    ``dg``/``du``: where to write (any row stride, unit column stride), e.g. ``g2d``/``u2d``
    themselves to overwrite the saved activations; fresh contiguous buffers when ``None``.
    ``h_out``: also write the forward's output ``silu(g)·u`` there, bit for bit as ``swiglu_fwd``
    with ``rounding`` (``dh2d`` itself may take it: each element's ``dh`` is read first).
    """
    n_rows, n_cols = g2d.shape
    if need_dg and dg is None:
        dg = torch.empty_like(g2d, memory_format=torch.contiguous_format)
    if need_du and du is None:
        du = torch.empty_like(u2d, memory_format=torch.contiguous_format)
    if not need_dg:
        dg = None
    if not need_du:
        du = None
    if n_rows == 0 or n_cols == 0 or not (need_dg or need_du or h_out is not None):
        return dg, du
    dg_arg = dg if dg is not None else g2d  # a valid pointer that the kernel never writes
    du_arg = du if du is not None else u2d
    h_arg = h_out if h_out is not None else g2d
    config = _fit(config, n_cols, dh2d, g2d, u2d, dg_arg, du_arg, h_arg)
    _swiglu_bwd_kernel[_grid(n_rows, n_cols, config)](
        dh2d, g2d, u2d, dg_arg, du_arg, h_arg, n_rows, n_cols,
        dh2d.stride(0), g2d.stride(0), u2d.stride(0), dg_arg.stride(0), du_arg.stride(0), h_arg.stride(0),
        BLOCK_ROWS=config.block_rows, BLOCK_COLS=config.block_cols, EVEN=_even(n_rows, n_cols, config),
        NEED_DG=need_dg, NEED_DU=need_du, STORE_H=h_out is not None, HF_ROUNDING=rounding == "hf",
        num_warps=config.bwd_warps,
    )
    return dg, du


# --------------------------------------------------------------------------------------------
# When may the backward write its gradients over the saved activations?
# --------------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` as ``[rows, width]`` with unit column stride, and whether that took a copy.

    A view whenever the leading dimensions collapse into one row stride (a column slice of a
    ``[.., 2I]`` buffer does); a copy only for layouts that no row stride describes.
    """
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    copied = x2d.numel() > 0 and x2d.data_ptr() != x.data_ptr()
    if x2d.shape[1] > 1 and x2d.stride(1) != 1:
        x2d, copied = x2d.contiguous(), True
    return x2d, copied


def _ownership(t: torch.Tensor) -> tuple[int, int, int]:
    """References to ``t``: C++ handles of its TensorImpl (a Python object counts once),
    Python references to its object (the caller's local, this frame and ``getrefcount``'s
    included), handles of its storage (every other tensor on the same memory adds one)."""
    return t._use_count(), sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _OwnershipProbe(torch.autograd.Function):
    """Reads ``_ownership`` of a saved tensor that nothing else holds — the output of an op
    that keeps no reference to it, saved by this node only — unpacked in the backward exactly
    as ``SwiGLUFunction.backward`` unpacks its own (one local, then ``_ownership``)."""

    counts: tuple[int, int, int] | None = None

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return t.clone()

    @staticmethod
    def backward(ctx, dy):
        (t,) = ctx.saved_tensors
        _OwnershipProbe.counts = _ownership(t)
        return dy


@functools.lru_cache(maxsize=1)
def _sole_owner_counts() -> tuple[int, int, int] | None:
    """``_ownership`` of an unshared saved tensor on this torch build, measured once on a few
    CPU elements; ``None`` if this build lacks the introspection (then never overwrite).

    Measured in a thread of its own: grad mode, inference mode and saved-tensor hooks (those of
    gradient checkpointing, say) are thread-local, so the caller's context cannot skew it.
    """
    found = []

    def probe():
        try:
            leaf = torch.zeros(2, requires_grad=True)
            _OwnershipProbe.apply(leaf * 1.0).sum().backward()
            found.append(_OwnershipProbe.counts)
        except Exception:  # noqa: BLE001 - any failure means: cannot tell, never overwrite
            pass

    thread = threading.Thread(target=probe, name="q35lab-swiglu-probe")
    thread.start()
    thread.join()
    return found[0] if found else None


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph`` or ``create_graph``)."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return True  # cannot tell: assume a second backward will come


#: "auto": overwrite a saved activation when ``_may_overwrite`` allows it; "never"; "always"
#: (benchmarks only, as Liger does: a retained graph or another reader would read gradients).
INPLACE_MODES = ("auto", "never", "always")


def _side_by_side(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are two column blocks of the rows of one buffer that share no
    element: the gate and up outputs of one fused ``[T, 2I]`` GEMM. Both ``[rows, width]`` with
    unit column stride and the same row stride ``s``; block ``b`` starts ``d`` elements after
    ``a`` (modulo ``s``) with ``width ≤ d ≤ s − width``. Written over together by a kernel that
    stores each element's gradients where it read its inputs, they cannot disturb each other."""
    if a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype or a.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    rows, width = a.shape
    if width > 1 and (a.stride(1) != 1 or b.stride(1) != 1):
        return False
    if rows == 1:  # one row each: two runs of `width` elements
        return abs(b.storage_offset() - a.storage_offset()) >= width
    if a.stride(0) != b.stride(0) or a.stride(0) < 2 * width:
        return False  # (a row stride below two widths cannot hold both: repeated or overlapping rows)
    gap = (b.storage_offset() - a.storage_offset()) % a.stride(0)
    return width <= gap <= a.stride(0) - width


def _may_overwrite(mode: str, t: torch.Tensor, counts, owned: bool, *others: torch.Tensor | None,
                   sibling: torch.Tensor | None = None) -> bool:
    """Whether the saved activation ``t`` may receive its own gradient: this backward is its
    last reader. ``counts``: ``_ownership(t)`` read by the backward right after unpacking;
    ``owned``: ``t`` is a copy this node made; ``sibling``: the node's other input when the two
    lie side by side in one buffer (``_side_by_side``): its handle on the memory is expected,
    and nothing else may hold one. Any doubt answers False (a fresh buffer)."""
    if mode != "auto":
        return mode == "always"
    if t.numel() == 0 or _graph_kept():
        return False  # a retained graph reads the activations again
    if any(o is not None and o is not sibling and o.numel()
           and o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in others):
        return False  # aliases the other input or the upstream gradient
    if owned:
        return True  # no one else ever saw it
    if t.is_leaf or t._base is not None:
        return False  # a leaf is the caller's tensor; a view shares its base's memory
    expected = _sole_owner_counts()
    if expected is None:
        return False
    if sibling is not None:  # the memory's one other handle: the sibling block's
        expected = (*expected[:2], expected[2] + 1)
    return all(n <= e for n, e in zip(counts, expected))


def _overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg: bool, need_du: bool, dh):
    """``(g2d, u2d, into_g, into_u)`` for a backward that unpacked ``gate`` and ``up``: their
    ``[rows, width]`` views and whether each gradient may be written over its input
    (``_may_overwrite``). The two halves of one fused gate/up output (the patched MLP's case) are
    each the other's only co-owner of the buffer, and both may be written over."""
    g2d, _ = _rows(gate)  # views: the saved tensors have a row stride by construction
    u2d, _ = _rows(up)
    pair = ctx.inplace == "auto" and _side_by_side(g2d, u2d)
    into_g = need_dg and _may_overwrite(ctx.inplace, gate, g_counts, ctx.owned[0], up, dh,
                                        sibling=up if pair else None)
    into_u = need_du and _may_overwrite(ctx.inplace, up, u_counts, ctx.owned[1], gate, dh,
                                        sibling=gate if pair else None)
    return g2d, u2d, into_g, into_u


def _bump_version(t: torch.Tensor) -> None:
    """A reader that ``_may_overwrite`` failed to see then fails loudly, not with gradients."""
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(t)


# --------------------------------------------------------------------------------------------
# Autograd and functional forms.
# --------------------------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    """Autograd node of ``swiglu``: saves ``gate`` and ``up`` (the tensors passed; a copy only
    of a layout without a row stride), nothing else; the backward writes the gradients over
    them when it is their last reader (``_may_overwrite``)."""

    @staticmethod
    def forward(ctx, gate, up, rounding: str, config: LaunchConfig | None, inplace: str):
        g2d, g_copied = _rows(gate)
        u2d, u_copied = _rows(up)
        # Allocated at its final shape, not a view of a buffer of this node: in-place edits of
        # the output (h.mul_(…)) then work as on any op's output.
        h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        swiglu_fwd(g2d, u2d, rounding, out=h.view(g2d.shape), config=config)
        ctx.save_for_backward(g2d if g_copied else gate, u2d if u_copied else up)
        ctx.shape, ctx.owned, ctx.config, ctx.inplace = gate.shape, (g_copied, u_copied), config, inplace
        return h

    @staticmethod
    @first_order_only
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        g_counts = _ownership(gate)  # first: nothing below may hold extra references yet
        u_counts = _ownership(up)
        need_dg, need_du = ctx.needs_input_grad[:2]
        g2d, u2d, into_g, into_u = _overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg, need_du, dh)
        dh2d, _ = _rows(dh)
        dg, du = swiglu_bwd(
            dh2d, g2d, u2d, need_dg=need_dg, need_du=need_du,
            dg=g2d if into_g else None, du=u2d if into_u else None, config=ctx.config,
        )
        if ctx.inplace == "auto":  # "always" (benchmarks) repeats backwards over the gradients
            if into_g:
                _bump_version(gate)
            if into_u:
                _bump_version(up)
        return (
            dg.detach().view(ctx.shape) if dg is not None else None,
            du.detach().view(ctx.shape) if du is not None else None,
            None, None, None,
        )


class SwiGLUPackedFunction(torch.autograd.Function):
    """Autograd node of ``swiglu_packed``: saves ``gate_up`` (one ``[.., 2I]`` buffer) and
    returns one ``[.., 2I]`` gradient — the saved buffer itself, overwritten, when safe."""

    @staticmethod
    def forward(ctx, gate_up, rounding: str, config: LaunchConfig | None, inplace: str):
        gu2d, copied = _rows(gate_up)
        half = gu2d.shape[1] // 2
        h = torch.empty((*gate_up.shape[:-1], half), dtype=gate_up.dtype, device=gate_up.device)
        swiglu_fwd(gu2d[:, :half], gu2d[:, half:], rounding, out=h.view(gu2d.shape[0], half), config=config)
        ctx.save_for_backward(gu2d if copied else gate_up)
        ctx.shape, ctx.owned, ctx.config, ctx.inplace = gate_up.shape, copied, config, inplace
        return h

    @staticmethod
    @first_order_only
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        counts = _ownership(gate_up)
        into = _may_overwrite(ctx.inplace, gate_up, counts, ctx.owned, dh)
        gu2d, _ = _rows(gate_up)
        half = gu2d.shape[1] // 2
        dgu = gu2d if into else torch.empty_like(gu2d, memory_format=torch.contiguous_format)
        dh2d, _ = _rows(dh)
        swiglu_bwd(dh2d, gu2d[:, :half], gu2d[:, half:], dg=dgu[:, :half], du=dgu[:, half:], config=ctx.config)
        if into and ctx.inplace == "auto":
            _bump_version(gate_up)
        return dgu.detach().view(ctx.shape), None, None, None


class SwiGLUDownFunction(torch.autograd.Function):
    """The first of ``swiglu_down``'s two nodes: ``h = silu(g)·u`` and the adapter's term
    ``t = s·(h·Aᵀ)·Bᵀ + b`` (without an adapter ``t`` is a zero-stride placeholder and the bias
    goes to the second node).

    Saves ``g``, ``u`` and the adapter's ``[T, r]`` ``xa = h·Aᵀ``, not ``h`` (``[T, I]``, 768 MiB a
    layer at 9B and 32k tokens): ``h`` is needed again only for the adapter's ``dA = dxaᵀ·h``, and
    the backward rebuilds it, bit for bit, in the buffer of ``dh`` once the SwiGLU kernel has
    read ``dh`` there.

    The two nodes are one function split in two, private to ``swiglu_down`` (``h`` and ``t`` are
    never returned), and their backward is split otherwise than their forward: the second node
    passes ``dt = dy`` on and gives ``h`` no gradient, and this node computes ``h``'s whole
    gradient from ``dt``, ``dh = dxa·A + dy·W`` with ``dxa = s·dy·B`` (``lora_linear``'s order: its
    bits). So ``dh`` is made here, after this node's saved tensors are unpacked (under
    checkpointing: after the recompute of the layer), and never meets the recompute's ``h``. One
    SwiGLU kernel then writes ``dg``, ``du`` (over ``g``, ``u`` when ``_may_overwrite`` allows) and
    ``h`` (over ``dh``)."""

    @staticmethod
    def forward(ctx, gate, up, weight, lora_A, lora_B, bias, scaling: float, rounding: str,
                config: LaunchConfig | None, inplace: str):
        g2d, g_copied = _rows(gate)
        u2d, u_copied = _rows(up)
        dtype, rows, N = gate.dtype, g2d.shape[0], weight.shape[0]
        h = swiglu_fwd(g2d, u2d, rounding, config=config)
        xa = None
        if lora_A is not None:
            xa = h @ lora_A.to(dtype).t()  # [T, r]
            t = torch.empty(rows, N, dtype=dtype, device=h.device)
            _project_into(t, xa, (lora_B * scaling).to(dtype), bias, None, None)  # the thin GEMM (+ bias)
        else:  # nothing to add: t only carries dy back to this node
            t = torch.zeros((), dtype=dtype, device=h.device).expand(rows, N)
        ctx.set_materialize_grads(False)  # h gets no gradient from the second node: no [T, I] of zeros
        # W is saved as well (a detached view of the parameter: its gradient is the second node's); saving
        # it keeps autograd's check that nothing edits it in place before the backward
        ctx.save_for_backward(g2d if g_copied else gate, u2d if u_copied else up, weight, lora_A, lora_B, xa)
        ctx.owned, ctx.scaling, ctx.rounding, ctx.config, ctx.inplace = (g_copied, u_copied), scaling, rounding, config, inplace
        ctx.shape, ctx.bias_dtype = gate.shape, None if bias is None else bias.dtype
        return h, t

    @staticmethod
    @first_order_only
    def backward(ctx, _, dt):
        if dt is None:  # y reached nothing that needs a gradient
            return (None,) * 10
        gate, up, weight, lora_A, lora_B, xa = ctx.saved_tensors
        g_counts = _ownership(gate)  # first: nothing below may hold extra references yet
        u_counts = _ownership(up)
        need_dg, need_du, _, need_a, need_bm, need_b = ctx.needs_input_grad[:6]
        dtype = gate.dtype  # dt's too: the second node casts dy to it
        dA = dB = db = None
        if need_bm:
            dB = _scaled_product(dt.t(), xa, ctx.scaling).to(lora_B.dtype)
        if need_b:
            db = dt.sum(0).to(ctx.bias_dtype)
        if not (need_dg or need_du or need_a):  # only B or the bias: no dh, no SwiGLU backward
            return None, None, None, None, dB, db, None, None, None, None
        dxa = None if lora_A is None else dt @ (lora_B * ctx.scaling).to(dtype)  # [T, r]: s · dy·B
        dh = _input_grad(dt, weight, dxa, lora_A)  # h's whole gradient, made after the unpacking above
        g2d, u2d, into_g, into_u = _overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg, need_du, dh)
        dg, du = swiglu_bwd(dh, g2d, u2d, need_dg=need_dg, need_du=need_du, dg=g2d if into_g else None,
                            du=u2d if into_u else None, h_out=dh if need_a else None, rounding=ctx.rounding,
                            config=ctx.config)
        h = dh if need_a else None  # dh's buffer now holds h
        if ctx.inplace == "auto":
            if into_g:
                _bump_version(gate)
            if into_u:
                _bump_version(up)
        if need_a:
            dA = (dxa.t() @ h).to(lora_A.dtype)
        return (dg.detach().view(ctx.shape) if dg is not None else None,
                du.detach().view(ctx.shape) if du is not None else None,
                None, dA, dB, db, None, None, None, None)


class _UnreadOutputs(threading.local):
    """Per thread (autograd's backward runs on its own): the list that ``unread_down_outputs``
    collects skipped outputs into, or None outside it."""

    skipped: list | None = None


_UNREAD = _UnreadOutputs()


@contextlib.contextmanager
def unread_down_outputs():
    """While active on this thread, ``swiglu_down``'s frozen down projection leaves its output
    uncomputed (``torch.empty``) and records it in the yielded list, with its version.

    For a recompute whose output only roots a backward, ``autograd.grad(y, inputs, dy)``: the down
    node's backward reads ``dy``, never ``y``, so the largest GEMM of an MLP need not run. A tiled
    MLP's backward recomputes each tile this way (``q35lab.long_context``), as the untiled MLP's
    checkpoint recompute stops before that GEMM. The caller must check that what it roots the
    backward on is one of the skipped outputs, unmodified (``is_unread``), and otherwise recompute
    without the context: an op that read the uncomputed values would have read garbage."""
    outer = _UNREAD.skipped
    _UNREAD.skipped = skipped = []
    try:
        yield skipped
    finally:
        _UNREAD.skipped = outer


def is_unread(y: torch.Tensor, skipped: list) -> bool:
    """Whether ``y`` is (a view of the whole of) one output ``unread_down_outputs`` skipped, not
    written since (its version counter: a write through ``.data`` or by a kernel that does not bump
    it goes unseen). With one output skipped, nothing computed from its values then reaches ``y``;
    with several, one could have fed another (the caller counts them)."""
    return any(y.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and y.numel() == out.numel()
               and out._version == version for out, version in skipped)


class DownProjectionFunction(torch.autograd.Function):
    """The second of ``swiglu_down``'s nodes: ``y = t + h·Wᵀ`` (without an adapter ``y = h·Wᵀ + b``,
    ``t`` a placeholder).

    With a frozen ``W`` it saves nothing: its backward only passes ``dy`` on as ``t``'s gradient
    (``h``'s is computed by the first node, see ``SwiGLUDownFunction``). That is the point of the
    split. Under gradient checkpointing (PyTorch's non-reentrant one, which transformers uses) the
    backward's recompute of a layer stops as soon as the layer's last saved tensor is made again;
    the down projection is the last GEMM of a decoder layer and its output feeds only the
    residual add, so when the node after ``g``, ``u`` and ``xa`` saves nothing, the recompute stops
    before this GEMM: the largest GEMM of the layer runs twice a step, not three times. A
    trainable ``W`` needs ``h`` for ``dW = dyᵀ·h``: then ``h`` is saved (and recomputed)."""

    @staticmethod
    def forward(ctx, h, t, weight, bias, out_shape: tuple, adapter: bool):
        dtype, N = h.dtype, weight.shape[0]
        y = torch.empty(*out_shape[:-1], N, dtype=dtype, device=h.device)  # its own tensor, not a view
        y2d = y.view(h.shape[0], N)
        skipped = _UNREAD.skipped
        if skipped is not None and not ctx.needs_input_grad[2]:  # nobody reads y (unread_down_outputs)
            skipped.append((y, y._version))
        elif adapter:
            torch.addmm(t, h, weight.to(dtype).t(), out=y2d)  # the base GEMM accumulates onto the adapter's term
        else:
            _project_into(y2d, h, weight, bias, None, None)
        ctx.dtype, ctx.weight_dtype = dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(h if ctx.needs_input_grad[2] else None)
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[2:4]
        dy2d = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1]).to(ctx.dtype)  # (-1 is ambiguous with no features)
        dW = (dy2d.t() @ h).to(ctx.weight_dtype) if need_w else None  # a trainable base: supported, not optimised
        db = dy2d.sum(0).to(ctx.bias_dtype) if need_b else None
        return None, dy2d, dW, db, None, None


def _check_rounding(rounding: object) -> None:
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")


def _inplace_mode(inplace_backward: object) -> str:
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward: expected a bool, got {type(inplace_backward).__name__}")
    if inplace_backward:
        _sole_owner_counts()  # measured once, here, rather than in the middle of a backward
    return "auto" if inplace_backward else "never"


@opaque_to_compile
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, rounding: str = "hf", inplace_backward: bool = True) -> torch.Tensor:
    """SwiGLU: ``silu(gate) · up``, fused, forward and backward.

    Args:
        gate: the gate projection's output, any leading shape, last dimension = width;
            bf16, fp16 or fp32; any row stride (e.g. a column slice of a ``[.., 2I]`` buffer).
        up: same shape, dtype and device as ``gate``; any row stride.
        rounding: ``"hf"`` (transformers: ``silu(gate)`` rounded, then the product) or
            ``"fused"`` (fp32 to the end, one rounding).
        inplace_backward: let the backward write the gradients over ``gate`` and ``up`` when
            nothing else can read them again (no retained graph, no other reference); False
            always allocates fresh gradient buffers.

    Returns:
        Tensor: a new contiguous tensor of ``gate``'s shape and dtype.

    Raises:
        TypeError: ``gate`` or ``up`` not a bf16/fp16/fp32 tensor, ``up`` of another dtype,
            ``inplace_backward`` not a bool.
        ValueError: ``up`` of another shape, the tensors on different devices, an unknown ``rounding``.
    """
    check_float_tensor("gate", gate)
    check_float_tensor("up", up)
    check_like("up", up, "gate", gate)
    check_kernel_device(gate=gate, up=up)
    _check_rounding(rounding)
    return SwiGLUFunction.apply(gate, up, rounding, None, _inplace_mode(inplace_backward))


@opaque_to_compile
def swiglu_packed(gate_up: torch.Tensor, *, rounding: str = "hf", inplace_backward: bool = True) -> torch.Tensor:
    """SwiGLU of a fused gate-up projection: ``silu(gate_up[..., :I]) · gate_up[..., I:]``.

    Args:
        gate_up: ``[.., 2I]``, gate in the first half, up in the second (one GEMM's output);
            bf16, fp16 or fp32; any row stride.
        rounding: ``"hf"`` or ``"fused"``, as for ``swiglu``.
        inplace_backward: as for ``swiglu``; the gradient is one ``[.., 2I]`` tensor, written
            over ``gate_up`` when nothing else can read it again.

    Returns:
        Tensor: a new contiguous ``[.., I]`` tensor of ``gate_up``'s dtype.

    Raises:
        TypeError: ``gate_up`` not a bf16/fp16/fp32 tensor, ``inplace_backward`` not a bool.
        ValueError: ``gate_up`` a scalar or of an odd width, an unknown ``rounding``.
    """
    check_float_tensor("gate_up", gate_up)
    check_kernel_device(gate_up=gate_up)
    if gate_up.dim() == 0:
        raise ValueError("gate_up: expected at least one dimension (gate and up, 2I wide), got a scalar")
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up: expected an even last dimension (gate and up halves), got {gate_up.shape[-1]}"
        )
    _check_rounding(rounding)
    return SwiGLUPackedFunction.apply(gate_up, rounding, None, _inplace_mode(inplace_backward))


@opaque_to_compile
def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor | None = None,
                lora_B: torch.Tensor | None = None, scaling: float = 1.0, bias: torch.Tensor | None = None, *,
                rounding: str = "hf", inplace_backward: bool = True) -> torch.Tensor:
    """An MLP's last two steps as two nodes: ``down(swiglu(gate, up))`` with ``down`` a frozen
    projection and an optional LoRA adapter without dropout,
    ``y = h·Wᵀ + b + scaling · (h·Aᵀ)·Bᵀ``, ``h = silu(gate)·up``.

    The same values and gradients as ``lora_linear(swiglu(gate, up), ...)``: the same GEMMs and
    formulas, ``h`` rebuilt bit for bit (through the interpreter every result is the same bits;
    compiled, the backward kernel's variant may round its products otherwise), without keeping
    ``h`` for the backward (``SwiGLUDownFunction``).

    Args:
        gate, up: as for ``swiglu`` (the column blocks of a fused gate/up output are fine).
        weight: ``[N, I]``; lora_A: ``[r, I]``; lora_B: ``[N, r]`` (both or neither); any float
            dtype (cast to ``gate``'s for the GEMMs; fp32 master adapters get fp32 gradients).
        scaling: the adapter scale, a finite real number. bias: optional ``[N]``.
        rounding, inplace_backward: as for ``swiglu``.
    """
    check_float_tensor("gate", gate)
    check_float_tensor("up", up)
    check_like("up", up, "gate", gate)
    _check_projection_args("gate", gate.shape[-1] if gate.dim() else "?", weight, lora_A, lora_B, bias)
    check_kernel_device(gate=gate, up=up, weight=weight, **{name: t for name, t in
                                                           (("lora_A", lora_A), ("lora_B", lora_B), ("bias", bias))
                                                           if t is not None})
    scaling = _check_scaling("scaling", scaling)
    _check_rounding(rounding)
    adapter = lora_A is not None  # the bias joins the adapter's term, or else the base GEMM, as lora_linear adds it
    with torch.autocast(device_type=gate.device.type, enabled=False):
        # the first node reads W for h's gradient but returns none for it (the second node's dW): it gets W
        # detached, so that a gradient wanted for W alone does not run the first node's backward
        h, t = SwiGLUDownFunction.apply(gate, up, weight.detach(), lora_A, lora_B, bias if adapter else None, scaling,
                                        rounding, None, _inplace_mode(inplace_backward))
        return DownProjectionFunction.apply(h, t, weight, None if adapter else bias, tuple(gate.shape), adapter)
