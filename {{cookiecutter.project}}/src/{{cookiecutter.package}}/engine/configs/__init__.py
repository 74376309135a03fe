"""The engine's configs: every group, option and setting default of a run, found by Hydra after the
project's own configs/ (configs/config.yaml puts this package on its search path), so that a file
there of the same path wins. Data of the package, installed with it."""
