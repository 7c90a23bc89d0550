"""Exceptions featcal raises for input it refuses, so the CLI can print them without a traceback."""

from __future__ import annotations


class FeatCalError(Exception):
    """Base class: a problem with the user's input or environment, reported as one clear message."""


class CheckpointError(FeatCalError):
    """A checkpoint is missing, unreadable, unsafe to load, or does not match the others."""


class ConfigError(FeatCalError):
    """An option, method name or parameter value is invalid."""


class CalibrationDataError(FeatCalError):
    """A calibration set is empty, too small, or does not fit the model."""


class SplitChoiceError(CalibrationDataError, ConfigError):
    """The split of a dataset cannot be chosen (several fit, none does, or the one named is not there)."""


class OutputExistsError(FeatCalError):
    """The output directory exists and is not empty, and overwriting was not requested."""


class UnsupportedModelError(FeatCalError):
    """The model's architecture cannot be calibrated (no stack of blocks found, a recurrent layer, ...)."""


class EvaluationDataError(FeatCalError):
    """An evaluation set is missing, unreadable, or lacks what a model needs to be scored on it."""


class CalibrationOverlapError(FeatCalError):
    """A model would be evaluated on examples it was calibrated on (featcal eval's leakage guard)."""


class MissingExtraError(FeatCalError):
    """An optional feature needs a package that is not installed (named with the featcal extra that brings it)."""
