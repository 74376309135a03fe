"""The engine: the recipe, checkpoints, tracking, distribution and the rest that the template
maintains (`cruft update` brings its fixes). Nothing here is yours to edit to bring a model, data,
task, metric or callback, and nothing here imports them: they are named by `_target_` in configs/.
What your side may take from here is `data` (`Data`, the type a data component returns, and
`read_file`) and the ready components of `ready/`, which take no more of it than yours may.

Its folders, a concern each, each `__init__` its map (docs/engine.md follows a run through them):

- checkpoint/: the run's checkpoints, one owner; checkpoint/remote/, their copy in an object store.
- data/: what a data component gives, and how the run draws from it; data/formats/, shards on disk.
- tracking/: MLflow, from the training process and in the sender process that talks to the store.
- callbacks/: your hooks, called at the recipe's points, their time bound and their state.
- lifecycle/: the run beyond one process: preemption, restarts, standby legs, goodput, divergence.
- ready/: the ready components your files import.
- configs/: every group, option and default of the engine's configs.

Its modules:

- train.py: the recipe, in its order: join, claim, assemble, restore, check, fit, finish.
- evaluating.py: eval.py's recipe; exporting.py: export.py's; saved_model.py: the checkpoint they take.
- config.py: the run's settings, typed and checked; config_roots.py: your configs/ over the engine's.
- components.py: components by `_target_`, their settings checked against their signatures, built.
- remembered.py: a run's settings from its checkpoint; targets.py: which `_target_` one may name.
- devices.py, distributed.py, strategies.py, precision.py: the device, the processes, the model's
  spread over them, autocast and the scaler.
- parts.py: what a step touches and a checkpoint saves; step.py: one optimizer step.
- validation.py: the validation loop; probe.py, continuity.py: the proof that a resume continued.
- param_groups.py, seeding.py, monitor.py, progress.py, compile_cache.py: the trained parameters,
  random state, optimized_metric, the progress shown, torch.compile's cache.
- provenance.py: what a run records about itself; priority.py: start-up work at the lowest priority.
- sweeps.py: multirun sweeps; compare.py: two runs side by side; update.py: around `cruft update`.
- errors.py, files.py, signals.py: the foundation, imported by all and importing none of them: the
  one-line errors, atomic writes and safe reads, the signals that stop a run.
- moved.py: where the modules of before the folders are now, for an old path that names one.
"""

from . import moved

moved.install()
