"""The signals that stop a run: SIGTERM (a scheduler taking the node back, or its time limit),
SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 (a scheduler's warning before either). The training process
takes them (lifecycle/preemption.py); every other process a run starts leaves them to it (its data
workers, its MLflow sender), since SLURM signals every process of a job. And `Stopped`, the exit a
stopped run ends with. Imported by those processes, this module imports nothing of the engine."""

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Stopped(SystemExit):
    """A run that a signal stopped, after its checkpoint was saved unless it says otherwise: exits
    128 + the signal, as a process the signal had killed would. `comeback` says how the job comes back by itself (a
    SLURM requeue), or is None when a person must continue it (with the command the stop line offers)."""

    def __init__(self, received: signal.Signals, comeback: str | None) -> None:
        super().__init__(128 + received)
        self.received, self.comeback = received, comeback
