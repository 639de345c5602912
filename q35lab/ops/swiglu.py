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

Memory. The node saves only its inputs ``g`` and ``u`` (the gate and up projections made them;
``h`` is saved by the down projection as its input). Its backward writes ``dg`` and ``du`` over
them, allocating nothing, when it is their last reader (``_ownership.may_overwrite``); otherwise
the gradients get fresh buffers and the inputs are never touched.

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
``swiglu_down`` (``ops/swiglu_down.py``) joins the SwiGLU and the MLP's down projection.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._autograd import first_order_only
from ._checks import check_float_tensor, check_kernel_device, check_like
from ._compile import opaque_to_compile
from ._launch import row_view
from ._ownership import bump_version, inplace_mode, may_overwrite, overwrite_plan, ownership
from ._tuned import tuned_config

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
    memory, as a copy does (a 2-D grid with rows on axis 0 sends them to the same columns of
    different rows)."""
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
# Launch configuration (ops/tuned.json may hold a GPU's own, keyed by width).
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
    2 rows × 2048, 17408 and 5120 → 4 rows × 1024: no padding), since masked half-blocks cost
    bandwidth. Narrow rows: one column block, rows stacked. More values a thread would slow the
    "hf" forward, whose IEEE division is long."""
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
# Autograd and functional forms.
# --------------------------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    """Autograd node of ``swiglu``: saves ``gate`` and ``up`` (the tensors passed; a copy only
    of a layout without a row stride), nothing else; the backward writes the gradients over
    them when it is their last reader (``may_overwrite``)."""

    @staticmethod
    def forward(ctx, gate, up, rounding: str, config: LaunchConfig | None, inplace: str):
        g2d, g_copied = row_view(gate)
        u2d, u_copied = row_view(up)
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
        g_counts = ownership(gate)  # first: nothing below may hold extra references yet
        u_counts = ownership(up)
        need_dg, need_du = ctx.needs_input_grad[:2]
        g2d, u2d, into_g, into_u = overwrite_plan(ctx, gate, up, g_counts, u_counts, need_dg, need_du, dh)
        dh2d, _ = row_view(dh)
        dg, du = swiglu_bwd(
            dh2d, g2d, u2d, need_dg=need_dg, need_du=need_du,
            dg=g2d if into_g else None, du=u2d if into_u else None, config=ctx.config,
        )
        if ctx.inplace == "auto":  # "always" (benchmarks) repeats backwards over the gradients
            if into_g:
                bump_version(gate)
            if into_u:
                bump_version(up)
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
        gu2d, copied = row_view(gate_up)
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
        counts = ownership(gate_up)
        into = may_overwrite(ctx.inplace, gate_up, counts, ctx.owned, dh)
        gu2d, _ = row_view(gate_up)
        half = gu2d.shape[1] // 2
        dgu = gu2d if into else torch.empty_like(gu2d, memory_format=torch.contiguous_format)
        dh2d, _ = row_view(dh)
        swiglu_bwd(dh2d, gu2d[:, :half], gu2d[:, half:], dg=dgu[:, :half], du=dgu[:, half:], config=ctx.config)
        if into and ctx.inplace == "auto":
            bump_version(gate_up)
        return dgu.detach().view(ctx.shape), None, None, None


def check_rounding(rounding: object) -> None:
    """Raise ``ValueError`` unless ``rounding`` is one of ``ROUNDINGS``."""
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")


@opaque_to_compile
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, rounding: str = "hf",
           inplace_backward: bool = True) -> torch.Tensor:
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
    check_rounding(rounding)
    inplace = inplace_mode(inplace_backward)
    check_kernel_device(gate=gate, up=up)
    return SwiGLUFunction.apply(gate, up, rounding, None, inplace)


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
    if gate_up.dim() == 0:
        raise ValueError("gate_up: expected at least one dimension (gate and up, 2I wide), got a scalar")
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up: expected an even last dimension (gate and up halves), got {gate_up.shape[-1]}"
        )
    check_rounding(rounding)
    inplace = inplace_mode(inplace_backward)
    check_kernel_device(gate_up=gate_up)
    return SwiGLUPackedFunction.apply(gate_up, rounding, None, inplace)


#: ``swiglu_down`` and its pieces live in ``ops/swiglu_down.py`` (which imports this module's kernels);
#: q35lab.patch and q35lab.long_context reach them through here.
