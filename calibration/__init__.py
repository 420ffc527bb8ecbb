"""Stage 1: reproducible calibration sets. `run(cfg, out)` builds one, `load(path)` reads and
verifies one, `ngram_overlap` measures how much of it leaks into a golden set."""

from quantgate.calibration.build import CalibrationSet, load, run
from quantgate.calibration.config import CalibrationConfig, Packing
from quantgate.calibration.overlap import DEFAULT_N, Overlap, ngram_overlap

__all__ = ["CalibrationConfig", "CalibrationSet", "Packing", "Overlap", "DEFAULT_N", "load", "ngram_overlap", "run"]
