"""Fused linear cross entropy: the loss over a 248,320-token vocabulary without all the logits.

For hidden states ``x`` ([T, H]), the LM head ``W`` ([V, H]) and targets ``t``::

    z_i    = x_i · Wᵀ                                 logits of token i, [V]
    lse_i  = log Σ_j exp(z_ij)                        fp32, online over blocks of V
    loss_i = lse_i − z_i,t_i                          0 where t_i = ignore_index
    loss   = Σ_i loss_i / n_valid  (mean),  Σ_i loss_i  (sum),  or loss_i  (none)

Gradients, with ``g_i`` the weight of token i in the reduction (1/n_valid, 1, or the upstream
gradient of loss_i) and ``p_i = softmax(z_i)``::

    dz_i = g_i · (p_i − onehot(t_i))                  written over z_i, in place
    dx_i = dz_i · W,      dW = Σ_i dz_iᵀ · x_i

Tokens are processed in chunks: per chunk one GEMM makes its logits ([C, V] in the compute
dtype), two Triton kernels turn each row into its loss and — in place — its logit gradient (a
row is split across programs: partial max and Σexp first, then the combined statistics), and
two GEMMs give the chunk's dx and its share of dW, accumulated in fp32 (cast once at the end).
Only one chunk of logits ever exists. For the
"mean" and "sum" reductions the gradients are computed during the forward (the upstream gradient
is a scalar, applied in backward); for "none" the backward recomputes each chunk's logits and
statistics with the per-token weights.

How it is launched (tokens per chunk, the trained head's gradient mode, the kernels' splits,
blocks and warps) is one ``LaunchConfig``: ``launch_config(vocab, hidden, dtype)`` gives this
GPU's tuned.json entry for ``vocab × hidden`` where there is one, else the heuristic default;
``linear_cross_entropy(..., config=)`` takes another.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import runtime
from ._autograd import first_order_only, graph_is_kept
from ._checks import check_float_tensor, check_int, check_kernel_device
from ._compile import opaque_to_compile
from ._launch import machine_balance
from ._linear import compute_dtype
from ._tuned import tuned_config

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ref", "LinearCrossEntropyFunction", "LaunchConfig",
           "launch_config", "default_chunk_size", "CHUNK_BYTES"]

#: Bytes one chunk of logits may take (in the compute dtype): the knob that trades memory for
#: GEMM size, read by the default launch configuration. ``linear_cross_entropy(..., chunk_size=N)``
#: overrides the rows per chunk directly.
CHUNK_BYTES = 256 * 2**20
REDUCTIONS = ("mean", "sum", "none")
WEIGHT_GRADS = ("auto", "accumulate", "recompute")


def linear_cross_entropy_ref(input, linear_weight, target, *, ignore_index=-100, reduction="mean"):
    """``cross_entropy(linear(input, W).float(), target)``: the materialising reference (fp64 stays fp64)."""
    logits = torch.nn.functional.linear(input, linear_weight)
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction).reshape(
        target.shape if reduction == "none" else ())


#: Columns of one row that one program handles (the default configuration's): a chunk has few,
#: very wide rows, so one program a row would leave the GPU a few long serial loops; each program
#: of a row records a partial (max, Σexp).
SPLIT_COLS = 16384


# --------------------------------------------------------------------------------------------
# Launch configuration.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchConfig:
    chunk_rows_trainable: int  # tokens per chunk of logits when the head is trained
    chunk_rows_frozen: int  # ... when it is frozen (no fp32 dW accumulator read per chunk)
    weight_grad: str  # how a trained head's dW is made: "accumulate" or "recompute"
    split_cols: int  # columns of a row one program of the two CE kernels handles
    ce_block: int  # widest block those programs load at once (a power of two)
    ce_warps: int
    grad_block_rows: int  # the tile of _softmax_grad_kernel ("recompute" only)
    grad_block_cols: int
    grad_warps: int
    vocab_block_bytes: int  # "recompute": bytes of one vocabulary block's logits over every token

    def __post_init__(self):
        if self.weight_grad not in WEIGHT_GRADS[1:]:
            raise ValueError(f"LaunchConfig.weight_grad: expected one of {WEIGHT_GRADS[1:]}, got {self.weight_grad!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "weight_grad" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"LaunchConfig.{field.name}: expected a positive int, got {value!r}")
        for name in ("ce_block", "grad_block_rows", "grad_block_cols"):
            if getattr(self, name) & (getattr(self, name) - 1):
                raise ValueError(f"LaunchConfig.{name}: expected a power of two, got {getattr(self, name)}")

    def chunk_rows(self, n_rows: int, head_trainable: bool) -> int:
        """Rows per chunk for ``n_rows`` tokens (never more than there are)."""
        rows = self.chunk_rows_trainable if head_trainable else self.chunk_rows_frozen
        return max(1, min(n_rows, rows))


def launch_config(vocab: int, hidden: int | None, dtype: torch.dtype) -> LaunchConfig:
    """This GPU's tuned configuration for ``vocab × hidden`` (tuned.json, written by
    ``python -m q35lab tune linear_cross_entropy``), else ``_default_config``. Not cached: it is one
    dictionary lookup a loss call, and the defaults read ``CHUNK_BYTES`` when called."""
    default = _default_config(vocab, dtype, hidden)
    return default if hidden is None else tuned_config("linear_cross_entropy", f"{vocab}x{hidden}", default)


def _default_config(vocab: int, dtype: torch.dtype, hidden: int | None = None) -> LaunchConfig:
    """As many rows per chunk as fit ``CHUNK_BYTES`` of logits (a power of two, for the GEMMs);
    more for a trained head (``_trainable_rows``); CE blocks of up to 4096 columns at 8 warps (4
    below that)."""
    vocab = max(vocab, 1)  # a head of no classes: any positive numbers do
    rows = max(1, CHUNK_BYTES // (vocab * torch.empty((), dtype=dtype).element_size()))
    rows = 1 << (rows.bit_length() - 1)
    block = min(4096, triton.next_power_of_2(min(vocab, SPLIT_COLS)))
    return LaunchConfig(
        chunk_rows_trainable=_trainable_rows(rows, hidden, machine_balance(runtime.DEVICE)),
        chunk_rows_frozen=rows, weight_grad="accumulate",
        split_cols=SPLIT_COLS, ce_block=block, ce_warps=8 if block >= 4096 else 4,
        grad_block_rows=16, grad_block_cols=256, grad_warps=4, vocab_block_bytes=CHUNK_BYTES,
    )


def _trainable_rows(rows: int, hidden: int | None, balance: float | None) -> int:
    """Rows per chunk for a trained head. Each chunk's dW is added into the ``[V, H]`` fp32
    accumulator, 8 bytes read and written per element against the chunk GEMM's ``2·C`` FLOPs per
    element: that traffic costs ``4·balance / C`` of the GEMM's time (``machine_balance``), so
    ``C ≈ 8·balance`` holds it near half. At most ``H`` rows: a chunk's logits stay within half
    the accumulator's bytes. Off a GPU (no balance), or for an unknown width, the frozen head's."""
    if balance is None or hidden is None:
        return rows
    wanted = 8 * balance
    nearest = 1 << round(math.log2(wanted))
    return max(rows, min(nearest, 1 << (max(hidden, 1).bit_length() - 1)))


@triton.jit
def _ce_partial_stats_kernel(
    LOGITS,  # [n_rows, n_cols]
    PART_MAX,  # [n_rows, n_splits] fp32 out: max of the split's logits
    PART_SUM,  # [n_rows, n_splits] fp32 out: Σ exp(z − that max) over the split
    n_cols,
    stride,
    cols_per_split,  # a multiple of BLOCK
    n_splits,
    BLOCK: tl.constexpr,
):
    """Online max and Σexp (fp32) over one split of one row."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = LOGITS + row * stride
    first = split * cols_per_split
    last = tl.minimum(first + cols_per_split, n_cols)
    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(first, last, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < last, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    tl.store(PART_MAX + row * n_splits + split, running_max)
    tl.store(PART_SUM + row * n_splits + split, running_sum)


@triton.jit
def _ce_finish_kernel(
    LOGITS,  # [n_rows, n_cols]: logits in; with COMPUTE_GRAD their gradient out, in place
    TARGET,  # [n_rows] int64
    SCALE,  # [n_rows] fp32: g_i, the weight of each row's loss in the reduction
    LOSS,  # [n_rows] fp32 out: lse − z_target, 0 for ignored rows
    PART_MAX,
    PART_SUM,  # [n_rows, n_splits] fp32, from _ce_partial_stats_kernel
    LSE,  # [n_rows] fp32 out when WRITE_LSE: log Σ exp z, for a later pass over the vocabulary
    n_cols,
    stride,
    ignore_index,
    cols_per_split,
    n_splits,
    SPLITS: tl.constexpr,  # n_splits rounded up to a power of two
    BLOCK: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Combine the row's partials: m = max_s m_s, Σ = Σ_s Σ_s·exp(m_s − m); the first split writes
    the loss lse − z_t = m + log Σ − z_t; with COMPUTE_GRAD every split writes
    g·(exp(z − m)/Σ − onehot(t)) over its columns.

    The softmax is exp(z − m) / Σ, not exp(z − lse): z − m is exact for the largest logits,
    where the gradient is largest, while lse carries a rounding of its own.
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = LOGITS + row * stride
    parts = tl.arange(0, SPLITS)
    part_mask = parts < n_splits
    part_max = tl.load(PART_MAX + row * n_splits + parts, mask=part_mask, other=-float("inf"))
    part_sum = tl.load(PART_SUM + row * n_splits + parts, mask=part_mask, other=0.0)
    row_max = tl.max(part_max, axis=0)
    row_sum = tl.sum(part_sum * tl.exp(part_max - row_max), axis=0)
    target = tl.load(TARGET + row)
    ignored = target == ignore_index
    if split == 0:
        z_target = tl.load(base + tl.where(ignored, 0, target)).to(tl.float32)
        tl.store(LOSS + row, tl.where(ignored, 0.0, (row_max - z_target) + tl.log(row_sum)))
        if WRITE_LSE:
            tl.store(LSE + row, row_max + tl.log(row_sum))
    if COMPUTE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(SCALE + row))
        inv_sum = 1.0 / row_sum
        first = split * cols_per_split
        last = tl.minimum(first + cols_per_split, n_cols)
        for start in range(first, last, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < last
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(z - row_max) * inv_sum - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=mask)


def _ce_rows(logits, target, scale, loss, ignore_index, compute_grad, config: LaunchConfig, lse=None):
    """Per row of ``logits``: the loss into ``loss``, with ``compute_grad`` the logit gradient
    over the logits (in place), and the log-sum-exp into ``lse`` if given. Two launches over a
    (rows × splits) grid."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = min(config.ce_block, triton.next_power_of_2(min(n_cols, config.split_cols)))
    cols_per_split = triton.cdiv(config.split_cols, block) * block
    n_splits = triton.cdiv(n_cols, cols_per_split)
    part_max = torch.empty((n_rows, n_splits), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    warps = config.ce_warps
    if compute_grad:
        # The finish kernel's first split reads the target logit from `logits`, where the split
        # holding the target column may already have written its gradient: programs of one row
        # run in no fixed order on a GPU. So the target logits are gathered first and the loss
        # is made from the kernel's log-sum-exp (an ignored row's -100 gathers column 0, unused).
        z_target = logits.gather(1, target.clamp(0, n_cols - 1)[:, None]).squeeze(1).float()
        if lse is None:
            lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    _ce_partial_stats_kernel[(n_rows, n_splits)](
        logits, part_max, part_sum, n_cols, logits.stride(0), cols_per_split, n_splits, BLOCK=block, num_warps=warps,
    )
    _ce_finish_kernel[(n_rows, n_splits)](
        logits, target, scale, loss, part_max, part_sum, loss if lse is None else lse, n_cols, logits.stride(0),
        ignore_index, cols_per_split, n_splits, SPLITS=triton.next_power_of_2(n_splits), BLOCK=block,
        COMPUTE_GRAD=compute_grad, WRITE_LSE=lse is not None, num_warps=warps,
    )
    if compute_grad:
        loss.copy_((lse - z_target).masked_fill_(target == ignore_index, 0.0))


@triton.jit
def _softmax_grad_kernel(
    Z,  # [n_rows, n_cols]: one block of the vocabulary's logits in; their gradient out, in place
    LSE,  # [n_rows] fp32
    TARGET,  # [n_rows] int64
    SCALE,  # [n_rows] fp32
    n_rows,
    n_cols,
    stride,
    first_class,  # the vocabulary index of column 0
    ignore_index,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """dz_ij = g_i · (exp(z_ij − lse_i) − [first_class + j = t_i]), 0 for ignored rows."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    z = tl.load(Z + offsets, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    target = tl.load(TARGET + rows, mask=row_mask, other=ignore_index)
    scale = tl.where(target == ignore_index, 0.0, tl.load(SCALE + rows, mask=row_mask, other=0.0))
    onehot = tl.where((first_class + cols)[None, :] == target[:, None], 1.0, 0.0)
    grad = (tl.exp(z - lse[:, None]) - onehot) * scale[:, None]
    tl.store(Z + offsets, grad.to(Z.dtype.element_ty), mask=mask)


def default_chunk_size(n_rows: int, vocab: int, dtype: torch.dtype, hidden: int | None = None,
                       head_trainable: bool = True) -> int:
    """Rows per chunk: ``launch_config(vocab, hidden, dtype).chunk_rows(n_rows, head_trainable)``
    (this GPU's tuned choice where recorded, else as many as fit ``CHUNK_BYTES`` of logits, more
    for a trained head)."""
    return launch_config(vocab, hidden, dtype).chunk_rows(n_rows, head_trainable)


def _addmm_into_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a·b, 16-bit operands into the fp32 ``acc`` in place (cuBLAS; CPU builds lack it)."""
    torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)


@functools.cache
def _mixed_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_addmm_into_fp32`` runs for ``dtype`` operands on ``device``: probed once, with
    a 1×1 product, so a real call never has to catch anything. An out-of-memory error is not an
    answer: it propagates."""
    acc = torch.zeros((1, 1), dtype=torch.float32, device=device)
    one = torch.ones((1, 1), dtype=dtype, device=device)
    try:
        _addmm_into_fp32(acc, one, one)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, AttributeError):  # NotImplementedError (no kernel) is a RuntimeError
        return False
    return True


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a·b with ``acc`` in fp32: each chunk's product is added unrounded (DESIGN: never
    rely on bf16 arithmetic — a bf16 accumulator would round once per chunk). Where the device
    has no mixed-precision GEMM the operands are upcast (an fp32 copy of both)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _mixed_gemm_available(acc.device, a.dtype):
        _addmm_into_fp32(acc, a, b)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunks(n_rows: int, chunk_size: int):
    for start in range(0, n_rows, chunk_size):
        yield slice(start, min(start + chunk_size, n_rows))


def _weight_grad_by_vocab_blocks(x2d, w, target, scale, lse, ignore_index, out_dtype, config: LaunchConfig):
    """dW block by block of the vocabulary, over every token at once: recompute the block's
    logits ([T, Vb]), turn them into their gradient with the saved log-sum-exp, and make
    dW_b = dz_bᵀ·x in one GEMM whose fp32 accumulator spans all T tokens (one rounding, and no
    [V, H] fp32 buffer: the price is a fourth logits-sized matmul)."""
    n_rows, vocab = x2d.shape[0], w.shape[0]
    if n_rows == 0:  # no tokens, no gradient
        return torch.zeros((vocab, w.shape[1]), dtype=out_dtype, device=x2d.device)
    block = max(1, min(vocab, config.vocab_block_bytes // (n_rows * x2d.element_size())))
    dw = torch.empty((vocab, w.shape[1]), dtype=out_dtype, device=x2d.device)
    for first in range(0, vocab, block):
        classes = slice(first, min(first + block, vocab))
        z = x2d @ w[classes].t()  # [T, Vb]
        grid = (triton.cdiv(n_rows, config.grad_block_rows), triton.cdiv(z.shape[1], config.grad_block_cols))
        _softmax_grad_kernel[grid](z, lse, target, scale, n_rows, z.shape[1], z.stride(0), first, ignore_index,
                                   BLOCK_ROWS=config.grad_block_rows, BLOCK_COLS=config.grad_block_cols,
                                   num_warps=config.grad_warps)
        if out_dtype == x2d.dtype:
            torch.mm(z.t(), x2d, out=dw[classes])
        else:  # e.g. an fp32 head with bf16 activations: accumulate in fp32, as the other path
            acc = torch.zeros((z.shape[1], x2d.shape[1]), dtype=torch.float32, device=x2d.device)
            _accumulate(acc, z.t(), x2d)
            dw[classes] = acc.to(out_dtype)
        del z  # before the next block's GEMM allocates its own, not after: one block alive at a time
    return dw


def _chunked_pass(x2d, weight, target, scale, loss_rows, ignore_index, want_dx, want_dw, config: LaunchConfig,
                  head_trainable: bool):
    """Chunks of tokens, each with its full rows of logits: every token's loss into ``loss_rows``
    and, when a gradient is wanted, the logit gradient in place (weighted by ``scale``), then the
    chunk's dx and its share of dW (fp32, cast once at the end). With
    ``config.weight_grad == "recompute"`` dW is not accumulated here: the pass records each
    token's log-sum-exp instead and ``_weight_grad_by_vocab_blocks`` makes dW afterwards.
    Returns (dx or None, dW or None)."""
    by_blocks = want_dw and config.weight_grad == "recompute"
    chunk_size = config.chunk_rows(x2d.shape[0], head_trainable)
    dx = torch.empty_like(x2d) if want_dx else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_dw and not by_blocks else None
    lse = torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device) if by_blocks else None
    grads = dx is not None or dw is not None  # only dx and the accumulated dW read the logit gradient
    w = weight.to(x2d.dtype)
    for rows in _chunks(x2d.shape[0], chunk_size):
        logits = x2d[rows] @ w.t()  # [C, V]: the only logits that exist at a time (see the del below)
        _ce_rows(logits, target[rows], scale[rows], loss_rows[rows], ignore_index, compute_grad=grads, config=config,
                 lse=None if lse is None else lse[rows])
        if dx is not None:
            torch.mm(logits, w, out=dx[rows])
        if dw is not None:
            _accumulate(dw, logits.t(), x2d[rows])
        # Freed here: rebinding `logits` to the next chunk's GEMM output would free this chunk
        # only after that output is allocated, so two chunks of logits would peak together.
        del logits
    if by_blocks:
        return dx, _weight_grad_by_vocab_blocks(x2d, w, target, scale, lse, ignore_index, weight.dtype, config)
    return dx, (None if dw is None else dw.to(weight.dtype))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """For "mean" and "sum" the forward makes the gradients for an upstream gradient of 1 and the
    backward scales them by the real one, a scalar. In place, when the backward frees the graph
    (the common ``loss.backward()``): then the saved gradients are returned as they are and
    become ``.grad`` without a copy. When the graph is kept (``retain_graph=True``, or
    ``autograd.grad`` twice), the saved gradients must survive for the next backward, so the
    scaled ones are new tensors: that backward holds one more ``[T, H]`` in the compute dtype
    (dx) and one more ``[V, H]`` in the head's dtype (dW, when the head is trained) than the
    in-place case.
    """

    @staticmethod
    def forward(ctx, x2d, weight, target, ignore_index: int, reduction: str, config: LaunchConfig,
                loss_shape: tuple[int, ...]):
        n_rows = x2d.shape[0]
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid = target != ignore_index
        n_valid = valid.sum()
        # "none": the loss is allocated in its final shape (no view made here: editable in place)
        loss = torch.empty(loss_shape if reduction == "none" else (n_rows,), dtype=torch.float32, device=x2d.device)
        loss_rows = loss.view(n_rows)
        grads_now = reduction != "none" and (needs_dx or needs_dw)
        if reduction == "mean":  # no counted token: weight 0, gradients 0, as cross_entropy's
            scale = valid.float() / n_valid.clamp_min(1)
        else:
            scale = valid.float()
        dx, dw = _chunked_pass(x2d, weight, target, scale, loss_rows, ignore_index,
                               grads_now and needs_dx, grads_now and needs_dw, config, needs_dw)
        ctx.reduction, ctx.ignore_index, ctx.config, ctx.grads_now = reduction, ignore_index, config, grads_now
        if grads_now:
            ctx.save_for_backward(dx, dw)
        else:
            ctx.save_for_backward(x2d, weight, target)
        if reduction == "none":
            return loss
        total = loss_rows.sum()
        # cross_entropy's mean over no counted token is 0/0 = NaN; so is this one
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss):
        if ctx.grads_now:
            dx, dw = ctx.saved_tensors
            # the upstream gradient is a scalar (1, or 1/accumulation steps); see the class docstring
            keep = graph_is_kept()
            if dx is not None:
                dx = dx * grad_loss.to(dx.dtype) if keep else dx.mul_(grad_loss.to(dx.dtype))
            if dw is not None:
                dw = dw * grad_loss.to(dw.dtype) if keep else dw.mul_(grad_loss.to(dw.dtype))
            return dx, dw, None, None, None, None, None
        x2d, weight, target = ctx.saved_tensors  # reduction="none": per-token upstream weights
        # the logits and their statistics are recomputed; the losses go to a scratch buffer
        scratch = torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device)
        dx, dw = _chunked_pass(x2d, weight, target, grad_loss.reshape(-1).to(torch.float32).contiguous(), scratch,
                               ctx.ignore_index, ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.config,
                               ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None, None


def _checks_on_host(device: torch.device) -> bool:
    """Whether a value check may read its verdict on the host: on the CPU it is there already;
    on a GPU reading it waits for everything queued before it (a sync every step)."""
    return device.type == "cpu"


def _check_target(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Class indices must be in ``[0, vocab)`` or ``ignore_index``.

    On the CPU a bad one raises ``ValueError`` at once. Elsewhere the check is queued on the
    device (``torch._assert_async``), with no host sync: a bad target then fails at the next
    synchronisation as a device-side assertion carrying the same message (and, like any device
    assertion, leaves the CUDA context unusable: the step was wrong anyway).
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    message = f"target: class indices must be in [0, {vocab}) or ignore_index={ignore_index}"
    if not _checks_on_host(target.device):
        torch._assert_async(~bad.any(), message)
    elif bool(bad.any()):
        raise ValueError(f"{message}, got {target[bad][0].item()}")


@opaque_to_compile
def linear_cross_entropy(input, linear_weight, target, *, ignore_index: int = -100, reduction: str = "mean",
                         chunk_size: int | None = None, weight_grad: str = "auto", config: LaunchConfig | None = None):
    """``cross_entropy(linear(input, linear_weight), target)`` without materialising the logits.

    Mirrors ``torch.nn.functional.linear_cross_entropy``: log-sum-exp and softmax in fp32, the
    logits made a chunk of rows at a time. Where no target is counted (no tokens, or all ignored)
    the result is what ``cross_entropy`` gives: "mean" NaN, "sum" 0, and zero gradients.

    Args:
        input (Tensor): ``[..., H]``; bf16, fp16 or fp32.
        linear_weight (Tensor): ``[V, H]``; its gradient is skipped when it does not require grad.
        target (Tensor): ``input.shape[:-1]``, int64 or int32 class indices in ``[0, V)`` or
            ``ignore_index``.
        ignore_index (int): a target not counted. Default: -100.
        reduction (str): ``"mean"``, ``"sum"`` or ``"none"``. Default: ``"mean"``.
        chunk_size (int, optional): rows of logits held at once. Default: the launch configuration's.
        weight_grad (str): how a trainable head's gradient is made: ``"accumulate"`` (each chunk's
            share added into an fp32 ``[V, H]`` buffer), ``"recompute"`` (block by block of the
            vocabulary in a second pass, no buffer; its dW may differ by about one ulp of the largest
            logit, relative) or ``"auto"`` (the configuration's). Default: ``"auto"``.
        config (LaunchConfig, optional): how it is launched. Default: ``launch_config(V, H, dtype)``.

    Returns:
        Tensor: the loss, a scalar (``"mean"``, ``"sum"``) or of ``target``'s shape (``"none"``), fp32.

    Raises:
        TypeError: ``input`` or ``linear_weight`` not a bf16/fp16/fp32 tensor, ``target`` not an
            int64/int32 tensor, ``ignore_index`` or ``chunk_size`` not an int, ``config`` not a
            ``LaunchConfig``.
        ValueError: shapes that do not match, an unknown ``reduction`` or ``weight_grad``, a
            ``chunk_size`` below 1, tensors on different devices, and on the CPU a target out of range
            (on a GPU that is a device-side assertion, checked without a host sync).
    """
    check_float_tensor("input", input)
    check_float_tensor("linear_weight", linear_weight)
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target: expected an int64 or int32 tensor of class indices, got "
                        f"{getattr(target, 'dtype', type(target).__name__)}")
    if input.dim() == 0 or linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        raise ValueError(f"linear_weight: expected [vocab, {input.shape[-1] if input.dim() else '?'}] "
                         f"(hidden = last dimension of input), got {tuple(linear_weight.shape)}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target: expected shape {tuple(input.shape[:-1])} (input without its last "
                         f"dimension), got {tuple(target.shape)}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    ignore_index = check_int("ignore_index", ignore_index, what="a target not counted")
    if chunk_size is not None:
        chunk_size = check_int("chunk_size", chunk_size, minimum=1, what="rows of logits held at once")
    if not isinstance(weight_grad, str) or weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"weight_grad: expected one of {WEIGHT_GRADS}, got {weight_grad!r}")
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config: expected a linear_cross_entropy LaunchConfig, got {type(config).__name__}")
    vocab, hidden = linear_weight.shape
    flat_target = target.reshape(-1).to(torch.int64).contiguous()
    _check_target(flat_target, vocab, ignore_index)
    check_kernel_device(input=input, linear_weight=linear_weight, target=target)
    dtype = compute_dtype(input)
    # the row count is given, not inferred: reshape(-1, 0) cannot infer it when H = 0
    x2d = input.reshape(math.prod(input.shape[:-1]), hidden).to(dtype).contiguous()
    config = launch_config(vocab, hidden, dtype) if config is None else config
    if chunk_size is not None:
        config = dataclasses.replace(config, chunk_rows_trainable=chunk_size, chunk_rows_frozen=chunk_size)
    if weight_grad != "auto":
        config = dataclasses.replace(config, weight_grad=weight_grad)
    with torch.autocast(device_type=input.device.type, enabled=False):
        return LinearCrossEntropyFunction.apply(x2d, linear_weight, flat_target, int(ignore_index), reduction,
                                                config, tuple(target.shape))
