"""Calibrate the cost model on the training device: time forward + backward, fit the terms.

The balancer evens the *modelled* cost of the ranks; the ranks wait on *measured* time. A
calibration measures the model the user trains (``package.module:factory``, or a transformer
described like the plan's ``cost.model``) on the user's device, over micro-batches packed with
chosen document lengths, and fits the terms the balancer uses::

    time(micro-batch) = micro_batch + piece * pieces + linear * sum(L) + quadratic * sum(L**2)
                        [+ encoder_linear * sum(P) + encoder_quadratic * sum(P**2), images]

by non-negative least squares on the relative error (:mod:`.fit`), then checks the fit on
held-back micro-batches shaped like a balancer's (mean and max relative error, rank
correlation). ``micro_batch`` is the same for every rank and stays out of the cost.

    from omniload_dask.calibrate import calibrate
    result = calibrate({"hidden": 64, "layers": 2, "heads": 4, "ffn": 256, "vocab": 256,
                        "gated": True}, seq_len=2048)
    print(result.summary())
    result.write("calibration.yaml")     # a plan: cost: {calibration: calibration.yaml}

or ``omniload calibrate MODEL --seq-len 2048 --out calibration.yaml``. Modules: ``grid``
(micro-batches to time), ``batches`` (their arrays), ``fit`` (numpy: features, NNLS, checks),
``runner`` (models and timing), ``steady`` (each micro-batch's time from drifting timings),
``transformer`` (the described model), ``calibration`` (the procedure), ``result`` (the
outcome and its file). Torch is imported when a calibration runs,
not with this package.
"""

from omniload_dask.calibrate.calibration import calibrate
from omniload_dask.calibrate.fit import TERMS, Check, Fit, check_fit, features, fit_terms, nnls
from omniload_dask.calibrate.grid import MicroBatch, fit_grid, held_back
from omniload_dask.calibrate.result import Calibration
from omniload_dask.calibrate.runner import StepTimer, load_model
from omniload_dask.calibrate.steady import Settled, judge_timings
from omniload_dask.errors import CalibrationError

__all__ = [
    "TERMS",
    "Calibration",
    "CalibrationError",
    "Check",
    "Fit",
    "MicroBatch",
    "Settled",
    "StepTimer",
    "calibrate",
    "check_fit",
    "features",
    "fit_grid",
    "fit_terms",
    "held_back",
    "judge_timings",
    "load_model",
    "nnls",
]
