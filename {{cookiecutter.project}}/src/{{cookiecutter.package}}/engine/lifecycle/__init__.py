"""The run's life beyond one process: how it stops, comes back, waits its turn, what its time went
to, and what it does when its loss stops being a number.

- preemption.py: a signal (signals.py) lets the step finish, then the run saves and stops.
- restarts.py: a job that comes back (a SLURM requeue, torchrun) continues as `resume=auto`.
- standby.py: a standby leg, started while another trains, that continues the run when it ends.
- goodput.py: the share of a run's wall time that trained new steps, over all its legs.
- divergence.py: `trainer.on_nonfinite`: stop, skip the step, or warn.
"""
