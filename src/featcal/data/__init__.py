"""Calibration data: read image folders, saved datasets, JSONL and parquet; preprocess for a model."""

from featcal.data.calibration import load_calibration_batches, sample_indices
from featcal.data.sources import open_source

__all__ = ["load_calibration_batches", "open_source", "sample_indices"]
