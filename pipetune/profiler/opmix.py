"""The operator mix of a few training steps, from the torch profiler.

:class:`OpMixRecorder` traces a handful of steps of an epoch: it leaves the first
``skip_steps`` steps alone (lazy initialisation, allocator growth, the data loader
starting), then records ``active_steps`` steps. The caller advances it from the
workload's step hook.

:func:`op_shares` turns the recorded events into shares of self time per category
(:data:`OP_CATEGORIES`), summing to 1:

* ``conv``: convolutions forward and backward (``aten::conv*``, ``mkldnn_convolution``,
  ``cudnn_convolution``, ``ConvolutionBackward``);
* ``matmul``: ``mm``, ``addmm``, ``bmm``, ``matmul``, ``linear``, ``einsum``, attention,
  recurrent layers (LSTM, GRU: matrix products inside);
* ``elementwise``: pointwise and other memory-bound ops: arithmetic, activations,
  dropout, softmax, losses, pooling, normalisation, ``fill_``/``zero_``;
* ``data``: everything under the DataLoader's ``enumerate(DataLoader)...`` events
  (fetch and collate), and ``collate`` events;
* ``other``: the rest, including Python time between operators (the step event's own
  time), copies and views, and optimiser bookkeeping.

An event whose name matches no category takes the category of its nearest matching
ancestor (``aten::t`` under ``AddmmBackward0`` is matmul work), and everything under a
data event is data. On CUDA the self device time of each operator is added to its self
CPU time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OP_CATEGORIES: tuple[str, ...] = ("conv", "matmul", "elementwise", "data", "other")

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_TOKEN_SPLIT = re.compile(r"[^a-z]+")
_MATMUL_TOKENS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "addmv",
    "mv", "dot", "gemm", "sgemm", "attention", "sdpa", "lstm", "gru", "rnn",
})
_ELEMENTWISE_TOKENS = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "pow",
    "reciprocal", "relu", "threshold", "clamp", "gelu", "silu", "elu", "selu", "hardtanh",
    "hardswish", "hardsigmoid", "leaky", "mish", "tanh", "sigmoid", "softplus", "dropout",
    "bernoulli", "softmax", "pool", "norm", "addcmul", "addcdiv", "lerp", "fill", "zero",
    "where", "maximum", "minimum", "sign", "sgn", "erf", "sin", "cos", "loss", "nll",
    "entropy", "masked",
})
#: Framework wrappers whose own time is Python bookkeeping, whatever their name says.
_WRAPPER_PREFIXES = ("pipetune::", "profilerstep", "optimizer.",
                     "torch::autograd::accumulategrad")


@functools.lru_cache(maxsize=4096)
def classify_op(name: str) -> str | None:
    """The category an event's *own name* puts it in, or None when it names none.

    >>> [classify_op(n) for n in ("aten::mkldnn_convolution", "aten::addmm", "aten::relu_",
    ...                           "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
    ...                           "aten::view")]
    ['conv', 'matmul', 'elementwise', 'data', None]
    """
    lowered = name.lower()
    if lowered.startswith("enumerate(dataloader)") or "collate" in lowered:
        return "data"
    if lowered.startswith(_WRAPPER_PREFIXES):
        return None
    # "autograd::engine::evaluate_function: ConvolutionBackward0" -> "ConvolutionBackward0"
    base = name.rsplit(": ", 1)[-1].rsplit("::", 1)[-1].split("#", 1)[0]
    base = _CAMEL.sub("_", base).lower()
    tokens = [t for t in _TOKEN_SPLIT.split(base) if t]
    if any(t.startswith("conv") and not t.startswith("convert") for t in tokens):
        return "conv"
    if any(t in _MATMUL_TOKENS for t in tokens) or "scaled_dot_product" in base:
        return "matmul"
    if any(t in _ELEMENTWISE_TOKENS or t.endswith("pool") for t in tokens):
        return "elementwise"
    return None


def op_shares(events: Iterable[Any], *, include_device: bool = False) -> dict[str, float]:
    """Shares of self time per category in ``events`` (torch ``FunctionEvent``-like:
    ``name``, ``cpu_parent``, ``cpu_children``, ``self_cpu_time_total``, and with
    ``include_device`` ``self_device_time_total``). All zero when there is no time."""
    totals = dict.fromkeys(OP_CATEGORIES, 0.0)
    roots = [e for e in events if getattr(e, "cpu_parent", None) is None and _is_cpu(e)]
    stack: list[tuple[Any, str | None]] = [(e, None) for e in roots]
    while stack:
        event, inherited = stack.pop()
        own = classify_op(event.name)
        category = "data" if inherited == "data" else (own or inherited)
        t = float(event.self_cpu_time_total)
        if include_device:
            t += float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        totals[category or "other"] += max(0.0, t)
        stack.extend((child, category) for child in event.cpu_children)
    whole = sum(totals.values())
    if whole <= 0:
        return dict.fromkeys(OP_CATEGORIES, 0.0)
    return {k: v / whole for k, v in totals.items()}


def op_shares_from_spans(spans: Iterable[tuple[str, int, int, int]]) -> dict[str, float]:
    """Shares of self time per category from ``(name, thread, start_ns, end_ns)`` spans.

    Spans on one thread nest like the scopes that made them; a span's self time is its
    length less its direct children's. Same rules as :func:`op_shares`, without building
    torch's event tree (ten times faster on a few thousand events).

    >>> op_shares_from_spans([("pipetune::step", 1, 0, 100), ("aten::addmm", 1, 10, 60),
    ...                       ("aten::relu", 1, 60, 80)])
    {'conv': 0.0, 'matmul': 0.5, 'elementwise': 0.2, 'data': 0.0, 'other': 0.3}
    """
    totals = dict.fromkeys(OP_CATEGORIES, 0.0)
    by_thread: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for name, thread, start, end in spans:
        if end >= start:
            by_thread[thread].append((start, -end, name))
    for entries in by_thread.values():
        entries.sort()
        # Open spans: [end, category, own length, children's length]
        stack: list[list[Any]] = []
        for start, neg_end, name in entries:
            end = -neg_end
            while stack and stack[-1][0] <= start:
                _close_span(stack.pop(), totals)
            parent = stack[-1] if stack else None
            if parent is not None:
                end = min(end, parent[0])  # a span never outlives its scope's parent
                parent[3] += end - start
            inherited = parent[1] if parent is not None else None
            own = classify_op(name)
            category = "data" if inherited == "data" else (own or inherited)
            stack.append([end, category, end - start, 0])
        while stack:
            _close_span(stack.pop(), totals)
    whole = sum(totals.values())
    if whole <= 0:
        return dict.fromkeys(OP_CATEGORIES, 0.0)
    return {k: v / whole for k, v in totals.items()}


def _close_span(span: list[Any], totals: dict[str, float]) -> None:
    _, category, length, children = span
    totals[category or "other"] += max(0, length - children)


def _kineto_spans(prof: Any) -> list[tuple[str, int, int, int]] | None:
    """Spans straight from a finished CPU-only profiler's kineto results, or None.

    (Every event of a CPU-only trace is a CPU op or a user annotation.)
    """
    results = getattr(prof, "kineto_results", None)
    if results is None:
        return None
    return [(e.name(), e.start_thread_id(), e.start_ns(), e.end_ns()) for e in results.events()]


def _is_cpu(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is None or getattr(device_type, "name", str(device_type)) == "CPU"


@dataclass(frozen=True)
class OpMix:
    """Shares per category, how many steps were recorded and a note on the source."""

    shares: dict[str, float]
    steps: int
    source: str


class OpMixRecorder:
    """Traces a few steps of one epoch with the torch autograd profiler (kineto).

    Call :meth:`start` before the epoch, :meth:`step` after every optimiser step and
    :meth:`finish` after the epoch. Steps ``skip_steps`` .. ``skip_steps +
    active_steps - 1`` (0-based) are traced, each inside a ``pipetune::step`` event so
    the Python time between operators is counted (as ``other``). If the epoch ends
    before the window is over, the steps recorded so far are used.

    ``torch.autograd.profiler.profile`` is used rather than ``torch.profiler.profile``:
    the latter imports ``torch._inductor`` when a trace starts, seconds of work inside
    the first profiled epoch of every process.
    """

    STEP_EVENT = "pipetune::step"

    def __init__(self, active_steps: int = 3, skip_steps: int = 2, device: str = "cpu"):
        self.active_steps = active_steps
        self.skip_steps = skip_steps
        self.device = device
        self._prof: Any = None
        self._mark: Any = None
        self._steps_seen = 0
        self._recorded = 0
        self._started = False
        self._done = False

    @property
    def first_traced_step(self) -> int:
        return self.skip_steps

    @property
    def last_traced_step(self) -> int:
        return self.skip_steps + self.active_steps - 1

    @property
    def running(self) -> bool:
        """True until the trace window is over (the step hook may stop calling then)."""
        return self._started and not self._done

    def start(self) -> None:
        self._prof = self._mark = None
        self._steps_seen = self._recorded = 0
        self._started, self._done = True, False
        if self.skip_steps == 0:
            self._begin()

    def step(self) -> None:
        """Advance by one training step; a no-op once the window is over."""
        if not self.running:
            return
        self._steps_seen += 1
        if self._prof is not None:
            self._close_mark()
            self._recorded += 1
            if self._recorded >= self.active_steps:
                self._end()
            else:
                self._open_mark()
        elif self._steps_seen == self.skip_steps:
            self._begin()

    def _begin(self) -> None:
        import torch

        self._prof = torch.autograd.profiler.profile(
            use_cpu=True, use_kineto=True,
            use_device="cuda" if self.device.startswith("cuda") else None,
        )
        with _native_stderr_silenced():
            self._prof.__enter__()
        self._open_mark()

    def _open_mark(self) -> None:
        import torch

        self._mark = torch.autograd.profiler.record_function(self.STEP_EVENT)
        self._mark.__enter__()

    def _close_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    def _end(self) -> None:
        self._close_mark()
        if self._prof is not None:
            with _native_stderr_silenced():
                self._prof.__exit__(None, None, None)
        self._done = True

    def finish(self) -> OpMix:
        """Stop tracing if still on and compute the shares."""
        if not self._started:
            return OpMix(dict.fromkeys(OP_CATEGORIES, 0.0), 0, "off")
        if not self._done:
            self._end()
        self._started = False
        prof, self._prof = self._prof, None
        if prof is None or self._recorded == 0:
            return OpMix(
                dict.fromkeys(OP_CATEGORIES, 0.0), 0,
                f"none: the epoch had {self._steps_seen} steps; the op mix skips the first "
                f"{self.skip_steps} and needs one more",
            )
        cuda = self.device.startswith("cuda")
        spans = None if cuda else _kineto_spans(prof)
        if spans is not None:
            shares = op_shares_from_spans(spans)
        else:  # device time needs torch's own event tree (kernels linked to their ops)
            shares = op_shares(prof.function_events, include_device=cuda)
        if sum(shares.values()) <= 0:
            return OpMix(shares, 0, "none: the trace held no operator time")
        return OpMix(shares, self._recorded, f"torch.profiler({self._recorded} steps)")


@contextlib.contextmanager
def _native_stderr_silenced():
    """Kineto writes "USDT: ... profiler_start/stop" lines straight to file descriptor 2
    at every trace start and stop, with no setting to turn them off; send fd 2 to
    /dev/null for those two calls only (about a millisecond each)."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
