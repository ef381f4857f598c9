"""Time the training model's forward and backward over micro-batches; imports torch when used.

:func:`load_model` gives the model to time (a factory's, or a described transformer) and
:class:`StepTimer` times steps on it (inputs from :func:`.batches.packed_arrays`).

A *step* is one or more micro-batches run one after another, forward and backward each, as a
trainer's step accumulates gradients. Timing is robust on a shared machine:

- on CPU with one thread, the timing thread's CPU time (a thread that waits for a core is
  not charged for the wait); with more threads, wall time; on CUDA, events around the step;
- every step is timed several times, the repeats interleaved over all steps in a seeded
  shuffled order (a disturbed minute touches every step a little, not a few steps a lot);
- :meth:`StepTimer.time` keeps every timing (the caller takes the best: disturbances only
  ever add time); :meth:`StepTimer.settle` fits each step's time at the machine's best
  speed from timings taken while that speed drifts, and goes on timing the steps whose
  figure is not yet confirmed (:mod:`.steady`): the calibration and the balance benchmark
  time one micro-batch per step;
- Python's garbage collector is paused while a step runs; inputs are built before timing, and
  gradients cleared after it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.calibrate.batches import packed_arrays
from omniload_dask.calibrate.grid import MicroBatch
from omniload_dask.calibrate.steady import Settled, judge_timings
from omniload_dask.errors import CalibrationError, OmniloadError
from omniload_dask.plan.cost import load_function
from omniload_dask.plan.fields import Fields
from omniload_dask.plan.parse_cost import read_model

__all__ = ["StepTimer", "check_description", "load_model"]


def check_description(description: Mapping[str, Any], field: str = "model") -> dict[str, Any]:
    """A transformer description, checked as the plan's ``cost.model`` is (a PlanError naming
    ``field``), and runnable: ``heads`` must divide ``hidden``."""
    model = read_model(Fields(description, field))
    heads = model.get("heads", max(1, model["hidden"] // 64))
    if model["hidden"] % heads:
        raise CalibrationError(
            f"{field}.heads: must divide hidden ({model['hidden']}), got {heads}"
        )
    return model


def load_model(
    model: str | Mapping[str, Any],
    device: Any,
    *,
    dtype: Any = None,
    attention: str = "auto",
    encoder: Mapping[str, Any] | None = None,
    patch_size: int = 14,
    merge: int = 2,
) -> tuple[Callable[[dict[str, Any]], Any], dict[str, Any]]:
    """The callable to time (batch dict -> loss) and what describes it in the calibration file.

    ``model`` is ``package.module:factory`` (called with the ``torch.device`` when it takes an
    argument) or a transformer description (see :mod:`omniload_dask.calibrate.transformer`).
    """
    import torch

    device = torch.device(device)
    if isinstance(model, str):
        if encoder is not None:
            raise CalibrationError("encoder: describes the built-in transformer's encoder; a "
                                   "model factory brings its own")  # fmt: skip
        return _from_factory(model, device), {"factory": model}
    from omniload_dask.calibrate.transformer import ATTENTION_MODES, build_transformer

    if attention not in ATTENTION_MODES:
        raise CalibrationError(
            f"attention: must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}"
        )
    desc = check_description(model)
    enc = check_description(encoder, "encoder") if encoder is not None else None
    net = build_transformer(desc, device, dtype=dtype, attention=attention, encoder=enc,
                            patch_size=patch_size, merge=merge)  # fmt: skip
    about: dict[str, Any] = {"transformer": desc, "attention": "jagged" if net.jagged else "loop"}
    if enc is not None:
        about["encoder"] = {**enc, "patch_size": patch_size, "merge": merge}
    return net, about


def _from_factory(reference: str, device: Any) -> Callable[[dict[str, Any]], Any]:
    """What ``package.module:factory`` returns for ``device``."""
    import inspect

    try:
        factory = load_function(reference)
    except ValueError as exc:
        raise CalibrationError(f"model {reference!r}: {exc}") from None
    try:
        needs = [
            p
            for p in inspect.signature(factory).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature to read: pass the device
        needs = [None]  # type: ignore[list-item]
    try:
        made = factory(device) if needs else factory()  # type: ignore[call-arg]
    except Exception as exc:
        raise CalibrationError(
            f"model {reference!r}: the factory failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(made):
        raise CalibrationError(
            f"model {reference!r}: the factory returned a {type(made).__name__}, not a callable "
            "that takes a batch and returns the loss"
        )
    return made  # type: ignore[no-any-return,unused-ignore]


class StepTimer:
    """Times forward + backward of ``model`` over micro-batches on ``device`` (module doc).

    ``vocab`` bounds the random token ids; images get ``patch_size`` square RGB patches,
    ``merge x merge`` of them per token.
    """

    def __init__(
        self,
        model: Callable[[dict[str, Any]], Any],
        device: Any,
        *,
        vocab: int = 256,
        threads: int = 1,
        patch_size: int = 14,
        merge: int = 2,
        seed: int = 0,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.device = torch.device(device)
        self.vocab = max(1, vocab)
        self.patch_size = patch_size
        self.merge = merge
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.threads = threads
        params = getattr(model, "parameters", None)
        self.parameters = list(params()) if callable(params) else []
        if self.device.type == "cuda":
            self.clock = "cuda events"
        else:
            self.clock = "thread CPU time" if threads == 1 else "wall time"

    def inputs(self, mb: MicroBatch) -> dict[str, Any]:
        """The micro-batch as the feeder gives it, random tokens and pixels, on the device."""
        arrays = packed_arrays(mb, self.vocab, self.rng, self.patch_size, self.merge)
        t = self.torch
        return {k: t.from_numpy(v).to(self.device) for k, v in arrays.items()}

    def run(self, step: Sequence[dict[str, Any]]) -> float:
        """Seconds of forward + backward over the micro-batches of ``step``, one after another."""
        torch = self.torch
        cuda = self.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
        clock = time.thread_time if self.clock == "thread CPU time" else time.perf_counter
        t0 = clock()
        for batch in step:
            self.model(batch).backward()
        if cuda:
            end.record()
            torch.cuda.synchronize(self.device)
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = clock() - t0
        for p in self.parameters:
            p.grad = None
        return seconds

    def time(
        self,
        steps: Sequence[Sequence[MicroBatch]],
        repeats: int = 3,
        warmup: int = 2,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Times of each step, ``(len(steps), repeats)``, the repeats interleaved (module doc).

        ``warmup`` untimed runs of the largest steps first (allocator, kernels, caches).
        """
        if repeats < 1:
            raise CalibrationError(f"repeats: must be >= 1, got {repeats}")
        inputs = self._prepare(steps, warmup)
        out = np.full((len(steps), repeats), np.inf)
        order_rng = np.random.default_rng(self.seed + 1)
        done = 0
        for r in range(repeats):
            for i, seconds in self._round(inputs, order_rng.permutation(len(steps))):
                out[i, r] = seconds
                done += 1
                if progress is not None:
                    progress(done, len(steps) * repeats)
        return out

    def settle(
        self,
        steps: Sequence[Sequence[MicroBatch]],
        *,
        keep: int = 6,
        min_repeats: int = 6,
        max_repeats: int = 24,
        tolerance: float = 0.015,
        steady: float = 0.5,
        window: int = 9,
        warmup: int = 2,
        progress: Callable[[int, int], None] | None = None,
    ) -> Settled:
        """Each step's time at the machine's best speed (:mod:`.steady`): ``min_repeats``
        shuffled rounds over all steps, then rounds over the steps not yet complete (fewer
        than ``keep`` timings counted, or a standard error over ``tolerance``), up to
        ``max_repeats`` timings of any step.

        A later round mixes in as many complete steps (at least ``window``) as it times
        incomplete ones, so that the machine's state around each timing is still judged from
        other steps' timings. A step left incomplete keeps its figure (``Settled.complete``
        and ``Settled.error`` say which, and how far it is from confirmed).
        """
        if not 1 <= min_repeats <= max_repeats:
            raise CalibrationError(
                f"repeats: need 1 <= min_repeats <= max_repeats, got {min_repeats}, {max_repeats}"
            )
        inputs = self._prepare(steps, warmup)
        n = len(steps)
        order_rng = np.random.default_rng(self.seed + 1)
        unit: list[int] = []  # every timing's step and seconds, in the order taken
        seconds: list[float] = []

        def judge() -> Settled:
            return judge_timings(np.asarray(unit, dtype=np.int64), np.asarray(seconds), n,
                                 keep=keep, tolerance=tolerance, steady=steady,
                                 window=window)  # fmt: skip

        verdict = judge()
        planned = n * min_repeats
        for r in range(max_repeats):
            if r < min_repeats:
                todo = order_rng.permutation(n)
            else:
                open_ = np.flatnonzero(~verdict.complete)
                if not len(open_):
                    break
                done = np.flatnonzero(verdict.complete)
                mix = order_rng.permutation(done)[: max(window, len(open_))]
                todo = order_rng.permutation(np.concatenate([open_, mix]))
                planned += len(todo)
            for i, t in self._round(inputs, todo):
                unit.append(i)
                seconds.append(t)
                if progress is not None:
                    progress(len(seconds), planned)
            verdict = judge()
        return verdict

    def _prepare(
        self, steps: Sequence[Sequence[MicroBatch]], warmup: int
    ) -> list[list[dict[str, Any]]]:
        """Every step's inputs on the device; ``warmup`` untimed runs of the largest steps."""
        inputs = [[self.inputs(mb) for mb in step] for step in steps]
        sizes = [sum(mb.tokens for mb in step) for step in steps]
        for i in sorted(range(len(steps)), key=lambda i: -sizes[i])[: max(0, warmup)]:
            self._guarded(inputs[i])
        return inputs

    def _round(
        self, inputs: Sequence[Sequence[dict[str, Any]]], order: np.ndarray
    ) -> Iterator[tuple[int, float]]:
        """One timing of each step in ``order``, the garbage collector paused meanwhile."""
        gc.collect()
        gc.disable()
        try:
            for i in order.tolist():
                yield int(i), self._guarded(inputs[i])
        finally:
            gc.enable()

    def _guarded(self, step: Sequence[dict[str, Any]]) -> float:
        """:meth:`run`, with a model failure as a CalibrationError."""
        try:
            return self.run(step)
        except OmniloadError:
            raise
        except Exception as exc:
            raise CalibrationError(
                f"the model failed on a micro-batch: {type(exc).__name__}: {exc}"
            ) from exc
