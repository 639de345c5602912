"""Where q35lab's kernels run: compiled on a GPU, or through the Triton interpreter on a CPU.

Triton decides between compiling and interpreting when a kernel is *defined* (``@triton.jit``
reads ``TRITON_INTERPRET`` at decoration time), so the choice must be made before any
``q35lab.ops`` module is imported. ``q35lab/__init__.py`` imports this module first.

The rule:

* ``Q35LAB_INTERPRET=1`` forces the interpreter, ``Q35LAB_INTERPRET=0`` forbids it;
* otherwise an explicit ``TRITON_INTERPRET`` set by the user is respected;
* otherwise the interpreter is chosen exactly when no CUDA device is visible.

On a GPU the interpreter is never chosen unless asked for. When it is chosen automatically,
one short notice says so (``python -m q35lab`` prints it itself, as a plain line, for the
commands that run kernels). Refusing the interpreter where no CUDA device is visible is an
error at import (``InterpreterRefusedError``), not a failure deep inside Triton later.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["INTERPRET", "DEVICE", "device", "smoke", "interpreter_notice", "quiet_notebook_notices", "Q35labNotice",
           "InterpreterRefusedError"]


class Q35labNotice(UserWarning):
    """An informational notice from q35lab (filter it with ``warnings.simplefilter``)."""


class InterpreterRefusedError(RuntimeError):
    """The interpreter was refused on a machine where compiled Triton cannot run (no CUDA device)."""


#: Said once when the interpreter is chosen automatically (a forced choice needs no notice).
NOTICE = ("q35lab: no CUDA device, so Triton kernels run through the Triton interpreter "
          "(correct, not fast; set Q35LAB_INTERPRET=1 to choose it without this notice).")


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={value!r}: expected 1 or 0")


def _choose_interpreter() -> tuple[bool, str]:
    forced = _env_flag("Q35LAB_INTERPRET")
    if forced is not None:
        return forced, "Q35LAB_INTERPRET"
    user_choice = _env_flag("TRITON_INTERPRET")
    if user_choice is not None:
        return user_choice, "TRITON_INTERPRET"
    return not torch.cuda.is_available(), "auto"


def _refuse_without_cuda(reason: str) -> None:
    """Compiled Triton needs a CUDA device: without one, Triton fails only at the first kernel
    launch, deep inside ("0 active drivers"). Say so at import, with what to do instead."""
    if torch.cuda.is_available():
        return
    raise InterpreterRefusedError(
        f"{reason}=0 refuses the Triton interpreter, but no CUDA device is visible, so q35lab's "
        f"Triton kernels cannot run here. Unset {reason} (or set Q35LAB_INTERPRET=1) to run them "
        "through the interpreter on the CPU, or use a machine with a CUDA GPU."
    )


#: The modules whose command line prints the notice itself, once its arguments are parsed.
_COMMAND_LINES = ("q35lab", "q35lab.__main__", "q35lab.e2e")


def _module_run_by_python_m() -> str | None:
    """The module ``python -m`` is starting while runpy locates it (``sys.argv[0]`` is "-m" until
    then), as the interpreter's own arguments name it (``-m q35lab`` or ``-mq35lab``); else None."""
    if sys.argv[:1] != ["-m"]:
        return None
    arguments = list(getattr(sys, "orig_argv", ()))[1:]
    for i, argument in enumerate(arguments):
        if argument == "-m":
            return arguments[i + 1] if i + 1 < len(arguments) else None
        if argument.startswith("-m"):
            return argument[2:]
    return None


def _cli_prints_the_notice() -> bool:
    """True while ``python -m q35lab`` (or ``q35lab.e2e``) imports this package: its command line
    prints the notice as a plain line, and only when kernels are about to run, not as a warning
    with a source line in ``--help`` or a usage error."""
    return _module_run_by_python_m() in _COMMAND_LINES


INTERPRET, _REASON = _choose_interpreter()
if INTERPRET:
    # Must happen before any @triton.jit in q35lab.ops runs.
    os.environ["TRITON_INTERPRET"] = "1"
    if _REASON == "auto" and not _cli_prints_the_notice():
        warnings.warn(NOTICE, Q35labNotice, stacklevel=2)
else:
    _refuse_without_cuda(_REASON)
    if _REASON == "Q35LAB_INTERPRET":
        os.environ.pop("TRITON_INTERPRET", None)


def interpreter_notice() -> str:
    """The notice when the interpreter was chosen automatically, else an empty string."""
    return NOTICE if INTERPRET and _REASON == "auto" else ""


def _round_bf16_to_nearest_in_interpreter() -> None:
    """Make the interpreter round fp32 → bf16 to nearest-even, as the GPU's ``cvt.rn`` does.

    Triton's interpreter (3.x, ``InterpreterBuilder.cast_impl``) converts fp32 to bf16 by
    dropping the low 16 bits: truncation, up to one bf16 ulp off. A kernel that rounds correctly
    on the GPU would then fail a numerics test on the CPU. Only that one conversion is replaced,
    with PyTorch's (round to nearest, ties to even); if the interpreter's internals differ, it is
    left alone.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - Triton without an interpreter
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or getattr(original, "_q35lab_rtne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            as_bf16 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(as_bf16.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._q35lab_rtne = True
    builder.cast_impl = cast_impl


def _reinterpret_triton_library() -> None:
    """Make Triton's own ``@triton.jit`` helpers (``tl.sum``, ``tl.sigmoid``, …) interpretable.

    They are wrapped when ``triton.language`` is imported: as compiled ``JITFunction``s if
    ``TRITON_INTERPRET`` was unset then. A user who imports transformers, peft or anything else
    that imports Triton *before* q35lab would otherwise get "Cannot call @triton.jit'd outside
    of the scope of a kernel" from the first interpreted kernel. Re-wrap them the way
    ``triton.jit`` would have under the interpreter.
    """
    if "triton.language" not in sys.modules:
        return  # imported later, under TRITON_INTERPRET=1: nothing to fix
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                setattr(module, name, InterpretedFunction(obj.fn))


if INTERPRET:
    _reinterpret_triton_library()
    _round_bf16_to_nearest_in_interpreter()


#: The device q35lab puts tensors on: the interpreter runs on CPU tensors.
DEVICE = torch.device("cpu") if INTERPRET or not torch.cuda.is_available() else torch.device("cuda")


def device() -> torch.device:
    """The device kernels run on (CPU tensors under the interpreter)."""
    return DEVICE


def smoke() -> bool:
    """True when only correctness can be checked: tiny sizes, no timings worth reporting."""
    return INTERPRET or DEVICE.type != "cuda"


#: Notices other libraries print that say nothing about a q35lab notebook (each harmless; what
#: prints it beside it).
_UNRELATED_WARNINGS = (
    "IProgress not found",  # tqdm without Jupyter's widgets
    "Attempting to run cuBLAS, but there was no current CUDA context",  # autograd's thread: makes its own
    "`is_gradient_checkpointing` is deprecated",  # PEFT reads it when it wraps; transformers 5.25 deprecates it
)


def quiet_notebook_notices() -> None:
    """Silence the notices that are not about the notebook, so that its outputs hold only its own.

    Call it before ``import transformers``: importing transformers imports tqdm, which warns at
    import. Besides ``_UNRELATED_WARNINGS`` it hides transformers' log line that the
    ``causal_conv1d`` package is not installed (notebook 07 is about that convolution). Every other
    warning and log line is left as it is.
    """
    for message in _UNRELATED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    from transformers.utils import logging as transformers_logging  # after the filters

    for handler in transformers_logging.get_logger().handlers:
        handler.addFilter(lambda record: "causal_conv1d" not in record.getMessage())
