"""Where a step's device time goes: its kernels by category, and the code that launched them.

One more training step runs under torch.profiler with CUDA activity and Python stacks
(``profile_step``); ``breakdown`` sums its kernels' device time by ``categorize``'s category and
names, for every category but GEMM, the launching Python frames that took the most of it.
"""

from __future__ import annotations

import collections
import functools
import json
import re
from pathlib import Path

import torch

from .memory import package_of
from .step import _training_setup, tokens, train_step

CATEGORIES = ("GEMM", "attention", "delta rule", "conv", "q35lab kernels", "copies/casts", "other elementwise")

#: Kernel names by category, tried in this order: memory-efficient attention kernels are cutlass
#: kernels (fmha_cutlassF_...) and cuDNN's convolutions implicit GEMMs (xmma_fprop_implicit_gemm),
#: so attention and conv come before GEMM. The aten names are the CPU profiler's ops.
_PATTERNS = (
    ("attention", re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention", re.I)),
    ("delta rule", re.compile(r"^chunk_|gated_delta|delta_rule|recompute_w_u|wy_repr|solve_tril|merge_16x16|l2norm")),
    ("conv", re.compile(r"conv|depthwise|fprop|dgrad|wgrad", re.I)),
    ("GEMM", re.compile(r"cutlass|cublas|xmma|gemm|nvjet"
                        r"|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation)$", re.I)),
    ("copies/casts", re.compile(r"copy|memcpy|(?<!no)cast|^aten::(to|clone|contiguous)$", re.I)),
)

#: Functions whose kernels belong to a category whatever their names (the PyTorch fallbacks of
#: the delta rule and the conv launch plain aten kernels: matmuls, cumsums, a depthwise conv).
_FUNCTION_CATEGORIES = (("gated_delta_rule", "delta rule"), ("causal_conv1d", "conv"))

_FRAME = re.compile(r"^(.*)\((\d+)\): (.*)$")  # a Python frame as the profiler names it: "path(line): function"
_RUNTIME = re.compile(r"^cu\w*(Launch|Memcpy|Memset)")  # the host's call that queued a kernel or a copy
_NODE = "autograd::engine::evaluate_function: "  # autograd's backward of one node


@functools.cache
def q35lab_kernels() -> frozenset[str]:
    """The Triton kernels of ``q35lab/ops/*.py`` (``@triton.jit`` functions), read from the source
    so that no op is imported."""
    names = set()
    for path in (Path(__file__).resolve().parents[2] / "ops").glob("*.py"):
        names.update(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", path.read_text()))
    return frozenset(names)


def categorize(kernel_name: str) -> str:
    """The category of a kernel, from its name as the torch profiler reports it (CUDA kernels, or
    aten ops in a CPU profile): q35lab's own Triton kernels by name, then ``_PATTERNS``, else
    "other elementwise"."""
    if kernel_name in q35lab_kernels():
        return "q35lab kernels"
    return next((category for category, pattern in _PATTERNS if pattern.search(kernel_name)), "other elementwise")


def _category(kernel_name: str, frames: list[str]) -> str:
    """``categorize``, corrected by who launched the kernel: a peer's kernel of a q35lab kernel's
    name (axolotl's ``_swiglu_fwd_kernel``) is that peer's elementwise kernel, and a generic kernel
    launched inside the delta rule or the conv is theirs (``_FUNCTION_CATEGORIES``)."""
    category = categorize(kernel_name)
    packages = {package_of(_FRAME.match(f)[1]) for f in frames}
    if category == "q35lab kernels" and "q35lab" not in packages and packages - {None}:
        return "other elementwise"
    if category in ("GEMM", "copies/casts", "other elementwise"):
        functions = [_FRAME.match(f)[3] for f in frames]
        for marker, owner in _FUNCTION_CATEGORIES:
            if any(marker in function for function in functions):
                return owner
    return category


# ----------------------------------------------------------------------------------------------
# Who launched a kernel
# ----------------------------------------------------------------------------------------------
def _chain(event):
    """The event and its enclosing CPU events, innermost first."""
    while event is not None:
        yield event
        event = event.cpu_parent


def _frames(event) -> list[str]:
    """Python frames around a CPU event, innermost first: the event's own stack where the
    profiler records one, and its enclosing Python-function events (``with_stack=True``)."""
    frames = []
    for e in _chain(event):
        frames += [f for f in e.stack or [] if _FRAME.match(f)]
        if _FRAME.match(e.name):
            frames.append(e.name)
    return frames


def _named(frames: list[str]) -> bool:
    return any(package_of(_FRAME.match(f)[1]) for f in frames)


class _Launchers:
    """For each kernel, the Python frames that launched it and the autograd node it ran in.

    A kernel's launcher is the host's runtime call with the same correlation id (its enclosing
    events are the aten op and the Python frames around it), else the op the profiler linked it to.
    Autograd's backward runs without the Python frames of the code it differentiates (on its
    own thread, on a GPU), so a kernel inside a node is named by the forward op that made the node
    (the same thread and sequence number), where one was recorded."""

    def __init__(self, cpu_events):
        self.runtime = {e.id: e for e in cpu_events if _RUNTIME.match(e.name)}
        self.ops = {e.id: e for e in cpu_events if not _RUNTIME.match(e.name)}
        self.by_sequence = collections.defaultdict(list)  # (thread, sequence number) -> forward ops, in time order
        for e in sorted(cpu_events, key=lambda e: e.time_range.start):
            if e.sequence_nr >= 0 and not e.name.startswith(_NODE):
                self.by_sequence[e.thread, e.sequence_nr].append(e)
        self.forward = {}  # (thread, sequence number) -> the frames of the first of them with named frames

    def launcher(self, kernel):
        """The CPU event that queued a kernel (its runtime call, else the op linked to it), or None."""
        # 0: linked to nothing (and the id of Python events); torch < 2.12's events have no such field,
        # so there a kernel is named only through its runtime call
        linked = getattr(kernel, "linked_correlation_id", 0)
        return self.runtime.get(kernel.id) or (self.ops.get(linked) if linked > 0 else None)

    def of_kernel(self, kernel) -> tuple[list[str], str | None]:
        return self.of_op(self.launcher(kernel))

    def of_op(self, op) -> tuple[list[str], str | None]:
        """(frames, autograd node or None) of a CPU event (None: unknown launcher)."""
        if op is None:
            return [], None
        frames = _frames(op)
        node = next((e for e in _chain(op) if e.name.startswith(_NODE)), None)
        if _named(frames) or node is None:
            return frames, None
        made_by = node.fwd_thread, node.sequence_nr  # the node's forward ran on its own thread's numbering
        if made_by not in self.forward:
            self.forward[made_by] = next((f for f in map(_frames, self.by_sequence[made_by]) if _named(f)), [])
        return self.forward[made_by], node.name.removeprefix(_NODE)


def source(frames: list[str], node: str | None) -> str:
    """``package:file.function`` of the innermost frame from ``memory.SOURCES``; inside autograd's
    backward "backward of <that>", or "backward: <node>" where the forward op is unknown."""
    for frame in frames:
        path, _, function = _FRAME.match(frame).groups()
        package = package_of(path)
        if package:
            name = f"{package}:{Path(path).stem}.{function}"
            return f"backward of {name}" if node else name
    if node:
        return f"backward: {node}"
    return "other Python" if frames else "no Python frame"


def aten_call(event) -> str:
    """The outermost aten op around a CPU event, with its inputs' shapes where the profiler recorded
    them (``record_shapes=True``): "aten::contiguous [[32768, 16, 128]]". It says what a kernel
    was for where no Python frame names its source (a copy is launched by ``aten::copy_`` inside
    ``aten::to``, ``aten::contiguous``, ``aten::repeat_interleave``, ...); "" for no aten op
    (``_kernels`` then names the kernel itself)."""
    ops = [e for e in _chain(event) if e.name.startswith("aten::")]
    if not ops:
        return ""
    shapes = [list(s) for s in (ops[-1].input_shapes or []) if s]
    return f"{ops[-1].name} {shapes}" if shapes else ops[-1].name


def _short(kernel_name: str, width: int = 90) -> str:
    """A kernel's name cut to ``width`` characters: C++ template arguments make some very long."""
    return kernel_name if len(kernel_name) <= width else kernel_name[:width - 1] + "…"


def _kernels(events):
    """(name, µs, frames, node, aten call) of every kernel of a profile. A profile without device
    events (a CPU run) yields its aten ops with their self time instead, through the same attribution."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    device = [e for e in events if e.device_type != DeviceType.CPU]
    launchers = _Launchers(cpu)
    if device:
        for kernel in device:
            op = launchers.launcher(kernel)
            call = aten_call(op) if op is not None else ""
            # No aten op around it (a Triton kernel launched from Python, a memset by the allocator):
            # its own name says more than nothing (the 35B-A3B's profile had 114 ms under "")
            yield kernel.name, kernel.device_time, *launchers.of_op(op), call or f"kernel: {_short(kernel.name)}"
        return
    for op in cpu:
        if op.name.startswith("aten::") and op.self_cpu_time_total > 0:
            yield op.name, op.self_cpu_time_total, *launchers.of_op(op), aten_call(op)


def breakdown(profiler_events, top: int = 3, threshold: float = 0.01) -> list[dict]:
    """One row per category (``CATEGORIES``, all of them): its device time (ms), its share of
    the step's, its number of kernels (``kernels``: launches, on a GPU), and for each category but
    GEMM above ``threshold`` of the step its ``top`` launching sources (``source``) and its
    ``top`` + 2 aten calls (``aten_call``; "kernel: <name>" for a kernel under no aten op) with
    their ms, as JSON (``sources``, ``aten_calls``).

    ``profiler_events``: ``prof.events()`` of a ``torch.profiler.profile(activities=[CPU, CUDA],
    with_stack=True)``; on a CPU, of a CPU-only profile (aten ops stand in for kernels)."""
    time, count = collections.Counter(), collections.Counter()
    sources = collections.defaultdict(collections.Counter)
    calls = collections.defaultdict(collections.Counter)
    for name, us, frames, node, call in _kernels(profiler_events):
        category = _category(name, frames)
        time[category] += us
        count[category] += 1
        sources[category][source(frames, node)] += us
        calls[category][call] += us

    def top_ms(counter, n):
        return json.dumps({key: round(us / 1e3, 3) for key, us in counter.most_common(n)})

    total = sum(time.values())
    rows = []
    for category in CATEGORIES:
        share = time[category] / total if total else 0.0
        named = category != "GEMM" and share > threshold
        rows.append({"category": category, "ms": time[category] / 1e3, "share": share, "kernels": count[category],
                     "sources": top_ms(sources[category], top) if named else "{}",
                     "aten_calls": top_ms(calls[category], top + 2) if named else "{}"})
    return rows


def profile_step(model, T: int, lr: float = 1e-4, compile: bool = False):
    """One more training step at ``T`` under torch.profiler — CUDA kernels on a GPU, with the
    host's ops and Python stacks to name their sources — and its events. Its optimizer is fresh,
    as in ``measure``: the first step's state initialisation is in it (a few fills). ``compile``:
    the step runs ``torch.compile(model)``, as ``measure``'s did (its compiled code reused).

    The profiler's Python tracer keeps pointers to code objects' names, so one freed during the
    step (a first call compiling something) leaves garbage that its parser rejects
    (UnicodeDecodeError; pytorch#64345, #113564): the step is then profiled once more, with nothing
    left to compile."""
    from torch.profiler import ProfilerActivity, profile

    device, vocab, optimizer = _training_setup(model, lr)
    ids = tokens(T, vocab, device, seed=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step_model = torch.compile(model) if compile else model
    for attempt in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities, with_stack=True, record_shapes=True) as prof:
            train_step(step_model, optimizer, ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
        try:
            return prof.events()
        except UnicodeDecodeError:
            if attempt:
                raise
