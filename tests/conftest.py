import atexit
import os
import random
import shutil
import tempfile

# Tests read the shipped ops/tuned.json only, never this machine's own tuning (~/.cache/q35lab/tuned.json):
# a GPU machine that ran `python -m q35lab tune` would otherwise test other launch configurations
os.environ["Q35LAB_TUNED_FILE"] = os.path.join(tempfile.mkdtemp(prefix="q35lab-tests-"), "tuned.json")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on a 2-core machine: one thread a worker, and one for every process a worker starts
    # (a notebook's kernel, the FSDP test's ranks): two threads each made four or more busy threads
    # on two cores, and OpenMP's spinning made notebook 06 take 339 s beside the FSDP test in CI
    # instead of 46 s alone
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import q35lab  # noqa: F401  (selects the interpreter before any kernel is defined)

atexit.register(shutil.rmtree, os.path.dirname(os.environ["Q35LAB_TUNED_FILE"]), True)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Fresh random inputs every run; the seed is printed with a failure so it can be replayed."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.fixture(autouse=True)
def roomy_host(monkeypatch):
    """The checkpoint offload refuses a copy that would leave the host less free memory than its
    reserve (q35lab.long_context.host_memory_available): what the tests check of it must not hang
    on how busy this machine is (the suite beside a notebook kernel left 12 GiB of 24 once, and
    six offload tests failed). Tests of the refusal, or of a sizing, set the host they need."""

    patch_everywhere(monkeypatch, "host_memory_available", lambda: 2**40)


#: Inductor on the CPU compiles C++: without a compiler its cases skip.
NEEDS_CXX = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                               reason="inductor on a CPU needs a C++ compiler")

#: The shapes a custom op's opcheck runs on: one row, odd widths, leading dimensions, a transposed view.
OPCHECK_SHAPES = pytest.mark.parametrize(
    "shape,strided", [((1, 64), False), ((7, 37), False), ((2, 3, 100), False), ((5, 48), True)],
    ids=["1x64", "7x37", "2x3x100", "5x48-transposed"])


def fresh_rows(shape, dtype, strided=False):
    """Fresh values of ``shape``; ``strided``: a transposed view (no unit column stride)."""
    from q35lab.runtime import device

    if not strided:
        return torch.randn(shape, device=device()).to(dtype)
    return torch.randn(*shape[:-2], shape[-1], shape[-2], device=device()).to(dtype).transpose(-1, -2)


#: The backend whole-model compile tests use: inductor, which users compile with, on a GPU; on the
#: CPU aot_eager, the same AOTAutograd trace inductor consumes without its C++ compile (a minute of
#: CI a model; the norms' own tests still run inductor on the CPU).
MODEL_COMPILER = "inductor" if torch.cuda.is_available() else "aot_eager"


def assert_one_graph(fn, *args) -> None:
    """``fn(*args)`` traces into one graph with no break (``torch._dynamo.explain``)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def graph_recorder():
    """A ``torch.compile`` backend (AOTAutograd, the graphs run as traced) and the dict in which it
    records the call targets of the forward and the backward graph it is given: ``{"fwd": {...}, "bwd": {...}}``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = {node.target for node in gm.graph.nodes}
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    return aot_autograd(fw_compiler=keep("fwd"), bw_compiler=keep("bwd")), graphs


def patch_everywhere(monkeypatch, name: str, value) -> None:
    """``monkeypatch.setattr`` of ``name`` in every q35lab module that binds the same object: a function is
    defined in one module and imported by name into the others that call it."""
    import sys

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("q35lab") and hasattr(m, name)]
    owners = [m for m in modules if getattr(getattr(m, name), "__module__", None) == m.__name__] or modules
    assert owners, f"no q35lab module defines {name}"
    original = getattr(owners[0], name)
    for module in modules:
        if getattr(module, name) is original:
            monkeypatch.setattr(module, name, value)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        for key, value in item.user_properties:
            if key == "seed":
                seed = f"(torch seed {value})"
                call.excinfo.value.args = (*call.excinfo.value.args, seed) if call.excinfo.value.args else (seed,)


@pytest.fixture
def tuned_tables(monkeypatch, tmp_path):
    """``ops._tuned`` on a pretend GPU, reading a copy of the shipped table (as ``TUNED_FILE``) and a
    user file (``$Q35LAB_TUNED_FILE``, not made yet) under tmp_path: the package's tuned.json and the
    user's own are neither read nor written. Yields (shipped copy, user file, the GPU's slug)."""
    import shutil

    from q35lab.ops import _tuned

    shipped, user = tmp_path / "shipped" / "tuned.json", tmp_path / "cache" / "tuned.json"
    shipped.parent.mkdir()
    shutil.copy(_tuned.TUNED_FILE, shipped)
    name = f"NVIDIA Pretend {random.randrange(10**6)}"
    monkeypatch.setattr(_tuned, "TUNED_FILE", shipped)
    monkeypatch.setenv("Q35LAB_TUNED_FILE", str(user))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    _tuned._table.cache_clear()
    _tuned.tuned_fields.cache_clear()
    yield shipped, user, _tuned.gpu_slug(name)
    _tuned._table.cache_clear()
    _tuned.tuned_fields.cache_clear()
