"""MLflow, one run per training job across any number of resumes: the training process's side,
which never imports MLflow, and the sender process that does (`python -m <package>.engine.tracking
drain`, started by the training process; `replay` sends what a run could not deliver).

- tracker.py: the training process's side: the Tracker that logs, and the sender's start.
- sender_pipe.py: the training process's end of the pipe to the sender process.
- sender.py: the sender process: the run opened or continued, what arrives delivered in batches.
- unsent.py: what a run has not delivered yet, kept in its checkpoint folder.
- mlflow_store.py: the store: its URI, client, the project's experiment, what a run records.
- mlflow_run.py: which MLflow run a leg writes into, and the settings it trains with now.
- logged_models.py: the run's checkpoints logged as MLflow models as it finishes.
- origin.py: what a run ran from: the git commit, the diff, the template, the packages.
- masking.py: what looks like a credential in a diff, masked before it leaves the machine.

What run.py and eval.py call, before they import torch, is here: `start_sender`, and `main`, the
sender's command line (__main__.py).
"""

from .tracker import main, start_sender

__all__ = ["main", "start_sender"]
