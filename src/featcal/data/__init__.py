"""The data seam: every calibration (and evaluation) source, read into examples (layer 1, `read_examples`)
and turned into model batches (layer 2, `load_calibration_batches` for one source; `open_calibration`, the one
door for every task's data, sources or batches, with `check()` and `load()`). docs/data.md lists the sources."""

from featcal.config.data import CalibrationOptions, calibration_options
from featcal.data.calibration import DataReader, load_calibration_batches, sample_indices
from featcal.data.calibration_set import CalibrationData, CalibrationSet, open_calibration
from featcal.data.examples import Examples, read_examples, read_examples_by_modality
from featcal.data.sources import open_source
from featcal.data.types import Example

__all__ = ["CalibrationData", "CalibrationOptions", "CalibrationSet", "DataReader", "Example", "Examples",
           "calibration_options", "load_calibration_batches", "open_calibration", "open_source", "read_examples",
           "read_examples_by_modality", "sample_indices"]
