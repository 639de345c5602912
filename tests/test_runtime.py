"""The interpreter is chosen before any kernel is defined, with one notice, and can be forced."""

import os
import subprocess
import sys

import pytest
import torch

PROBE = (
    "import warnings, os\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    import q35lab\n"
    "from q35lab.ops.offset_rms_norm import _offset_rms_norm_fwd_kernel as k\n"
    "print(q35lab.runtime.INTERPRET, type(k).__name__, os.environ.get('TRITON_INTERPRET'),\n"
    "      sum(issubclass(w.category, q35lab.runtime.Q35labNotice) for w in caught))\n"
)


def _probe(**env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_cpu_import_selects_interpreter_with_one_notice():
    interpret, kernel_type, env_value, notices = _probe()
    assert interpret == "True" and kernel_type == "InterpretedFunction" and env_value == "1"
    assert notices == "1"


def test_forcing_the_interpreter_is_silent():
    interpret, kernel_type, _, notices = _probe(Q35LAB_INTERPRET="1")
    assert interpret == "True" and kernel_type == "InterpretedFunction" and notices == "0"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device")
def test_refusing_the_interpreter():
    interpret, kernel_type, env_value, notices = _probe(Q35LAB_INTERPRET="0", TRITON_INTERPRET="1")
    assert interpret == "False" and kernel_type == "JITFunction" and env_value == "None"
    assert notices == "0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("variable", ["Q35LAB_INTERPRET", "TRITON_INTERPRET"])
def test_refusing_the_interpreter_without_cuda_fails_at_import_saying_what_to_do(variable):
    """Not an import that works and a kernel that fails deep inside Triton ("0 active drivers")."""
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    script = ("try:\n    import q35lab\nexcept RuntimeError as exc:\n"
              "    print(type(exc).__name__)\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", script], env={**env, variable: "0"}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    name, message = out.stdout.split("\n", 1)
    assert name == "InterpreterRefusedError"
    assert f"{variable}=0 refuses the Triton interpreter, but no CUDA device is visible" in message
    assert f"Unset {variable}" in message and "Q35LAB_INTERPRET=1" in message and "CUDA GPU" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_the_command_line_prints_the_notice_itself():
    """``python -m q35lab --help`` shows no notice; as a library, one notice is a warning (above)."""
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-m", "q35lab", "--help"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == ""


def test_bad_flag_value_is_named():
    env = dict(os.environ, Q35LAB_INTERPRET="maybe")
    out = subprocess.run([sys.executable, "-c", "import q35lab"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "Q35LAB_INTERPRET" in out.stderr


def test_interpreter_rounds_bf16_to_nearest_even():
    import triton
    import triton.language as tl

    from q35lab.runtime import INTERPRET, device

    if not INTERPRET:
        pytest.skip("interpreter only")

    @triton.jit
    def _cast(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    x = torch.randn(1000, device=device()) * 100
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-9])  # ties and below
    y = torch.empty(1000, dtype=torch.bfloat16, device=device())
    _cast[(1,)](x, y, 1000, BLOCK=1024)
    assert torch.equal(y, x.to(torch.bfloat16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_interpreter_works_when_triton_was_imported_first():
    """transformers/peft import Triton before q35lab in a user's script: kernels must still run."""
    script = (
        "import triton.language, peft, transformers\n"  # Triton's helpers wrapped as compiled JITFunctions
        "import torch, q35lab\n"
        "x = torch.randn(5, 64)\n"
        "y = q35lab.offset_rms_norm(x, torch.zeros(64))\n"
        "ref = q35lab.ops.offset_rms_norm.offset_rms_norm_ref(x, torch.zeros(64))\n"
        "g = q35lab.gated_rms_norm(x, x, torch.ones(64))\n"
        "print(torch.allclose(y, ref, atol=1e-5), torch.isfinite(g).all().item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("Q35LAB_INTERPRET", "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


def test_a_cpu_tensor_where_triton_runs_compiled_is_named(monkeypatch):
    """On a GPU machine the kernels run compiled and cannot read host memory: a CPU tensor gets a
    q35lab error naming the argument, not Triton's launch error (notebook 06 met it on the H200)."""
    import q35lab
    from q35lab.ops.contiguous_rows import contiguous_rows
    from q35lab.ops.swiglu_down import swiglu_down

    monkeypatch.setattr(q35lab.runtime, "INTERPRET", False)
    rows, width, experts = 3, 40, 4
    x, w = torch.randn(rows, width), torch.randn(width)
    gate, up = torch.randn(rows, 2 * width), torch.randn(rows, 2 * width)
    calls = [  # (the argument the error names, the call)
        ("x", lambda: q35lab.offset_rms_norm(x, w)),
        ("x", lambda: q35lab.gated_rms_norm(x, torch.randn(rows, width), w)),
        ("gate", lambda: q35lab.swiglu(gate, up)),
        ("gate", lambda: swiglu_down(gate, up, torch.randn(width, 2 * width))),
        ("gate_up", lambda: q35lab.swiglu_packed(torch.randn(rows, 4 * width))),
        ("input", lambda: q35lab.linear_cross_entropy(x, torch.randn(7, width), torch.randint(0, 7, (rows,)))),
        ("x", lambda: q35lab.causal_conv1d(torch.randn(1, rows, width), torch.randn(width, 4))),
        ("x", lambda: q35lab.routed_experts(x, torch.randint(0, experts, (rows, 2)), torch.rand(rows, 2),
                                                        torch.randn(experts, 2 * 8, width),
                                                        torch.randn(experts, width, 8))),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"^{name}: expected a CUDA tensor, got one on cpu"):
            call()
    strided = torch.randn(5, 2 * width)[:, :width]  # rows with a stride: the kernel's case, copied by torch here
    copied = contiguous_rows(strided)
    assert copied.is_contiguous() and torch.equal(copied, strided)


QUIET_PROBE = (
    "import logging, warnings\n"
    "from q35lab import runtime\n"
    "runtime.quiet_notebook_notices()\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.warn('IProgress not found. Please update jupyter and ipywidgets.')\n"
    "    warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning)\n"
    "    warnings.warn('a warning of the notebook itself')\n"
    "print('warned:', [str(w.message) for w in caught])\n"
    "from transformers.utils import logging as tl\n"
    "tl.get_logger('transformers.models.qwen3_5').warning('causal_conv1d is not installed')\n"
    "tl.get_logger('transformers.models.qwen3_5').warning('a log line of the notebook itself')\n"
)


def test_quiet_notebook_notices_hides_only_the_unrelated_ones():
    env = dict(os.environ, Q35LAB_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", QUIET_PROBE], env=env, capture_output=True, text=True, check=True)
    assert "warned: ['a warning of the notebook itself']" in out.stdout
    assert "a log line of the notebook itself" in out.stderr and "causal_conv1d" not in out.stderr
