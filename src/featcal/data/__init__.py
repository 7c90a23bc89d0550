"""The data seam: every calibration (and evaluation) source, read into examples (layer 1, `read_examples`)
and turned into model batches (layer 2, `load_calibration_batches`). docs/data.md lists the sources."""

from featcal.data.calibration import load_calibration_batches, sample_indices
from featcal.data.examples import Examples, read_examples, read_examples_by_modality
from featcal.data.sources import open_source
from featcal.data.types import Example

__all__ = ["Example", "Examples", "load_calibration_batches", "open_source", "read_examples",
           "read_examples_by_modality", "sample_indices"]
