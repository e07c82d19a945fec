"""Calibration: refit a profile to measured micro-batches and steps, online or offline; torch-free.

Modules, one line each:

- ``measurements``: what a measurement is, the bounded buffer;
- ``coefficients``: the coefficient vector of a refit, read from and written into a profile;
- ``features``: what a dense refit prices (features, vectorised prediction, natural scales);
- ``fit``: the robust refit of a profile (fit_profile), and judging it on held-out measurements;
- ``mix``: the same for layer-mix profiles, priced by the exact model;
- ``level``: the robust level of a regime (a uniform rescale);
- ``change``: change detection (did the machine change, and at which step);
- ``records``: what travels through the Store (measurement records, model versions);
- ``online``: OnlineCalibrator, refits while training runs;
- ``pipeline``: the same refit for pipelined steps, and the measured stage-to-stage link.
- ``step_fit``: StepFit, the per-step part outside micro-batches (wall clock minus busy time).
"""

from dyncp.cost_model.calibration.fit import CalibrationResult, fit_profile, prediction_errors
from dyncp.cost_model.calibration.measurements import (
    BufferedMeasurement,
    CalibrationError,
    Measurement,
    MeasurementBuffer,
    WaveMeasurement,
)
from dyncp.cost_model.calibration.online import OnlineCalibrator
from dyncp.cost_model.calibration.records import (
    MeasurementRecord,
    ModelVersion,
    decode_measurements,
    encode_measurements,
)

__all__ = [
    "BufferedMeasurement",
    "CalibrationError",
    "CalibrationResult",
    "Measurement",
    "MeasurementBuffer",
    "MeasurementRecord",
    "ModelVersion",
    "OnlineCalibrator",
    "WaveMeasurement",
    "decode_measurements",
    "encode_measurements",
    "fit_profile",
    "prediction_errors",
]
