"""Jobs that come back without a person: a SLURM job that saved because it was preempted or ran
out of time requeues itself, and a job that came back (requeued by SLURM, restarted by torchrun)
continues from its newest checkpoint as if started with `resume=auto`.

SLURM signals every process of a job and kills them after a grace time (or `KillWait`). The run
takes the signal at a step boundary and saves (preemption.py); then, under SLURM, rank 0 asks for a
requeue when the signal means the job should come back:
- SIGUSR1 or SIGUSR2: sent only when asked for (`sbatch --signal`, which submitit sets through
  `signal_delay_s` to come before the time limit, or `scancel --signal`), to save and come back.
- SIGTERM: when SLURM says the job is being preempted (it has a `PreemptTime`) or is at its time
  limit (`Reason=TimeLimit`); not when a person cancelled it (`scancel`), which also sends SIGTERM.
  A job SLURM has requeued already (`scontrol requeue`, a preemption without grace time) counts
  one more restart than it started with, and just comes back.
- SIGINT: a person at the keyboard; never.
The run requeues itself because SLURM does not: a preempted job that ends on its own inside its
grace time is recorded FAILED and stays so, as does one at its time limit.
"""

import logging
import os
import re
import signal
import subprocess

from ..distributed import launcher_number
from ..errors import RunError

log = logging.getLogger(__name__)

# How many times the job has come back, as SLURM and torchrun count.
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
COMES_BACK = (signal.SIGUSR1, signal.SIGUSR2)


def implied_resume(resume: str | None) -> str | None:
    """`resume`, or `auto` for a job that came back by itself without a `resume=`: the command
    line that started it (the sweep line of docs/sweeps.md, say) must continue it, not refuse to start over
    its checkpoints. Read at the start, with the job's id that a requeue needs: a variable set by hand
    that cannot be used fails here, in one line, not after the save that a signal asked for."""
    slurm_job()
    counts = {variable: launcher_number(variable, 0) for variable in RESTART_COUNTS}
    if resume is not None:
        return resume
    for variable, count in counts.items():
        if count > 0:
            log.info(f"{variable}={count}: this job came back by itself, so it continues with resume=auto")
            return "auto"
    return None


def requeue(received: signal.Signals) -> str | None:
    """Requeues this SLURM job when `received` means it should come back (see above); returns a
    line saying that it comes back, or None when it does not by itself (not under SLURM, a
    person's signal, or a requeue SLURM refused, which is logged)."""
    job = slurm_job()
    if job is None or received == signal.SIGINT:
        return None
    comes_back = f"SLURM job {job} is requeued: it continues from this checkpoint when it runs again"
    shown = scontrol("show", "job", "-o", job)
    fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout if shown else ""))
    # Requeued already: by `scontrol requeue`, or by a preemption without grace time.
    if int(fields.get("Restarts", 0)) > launcher_number("SLURM_RESTART_COUNT", 0):
        return comes_back
    preempted = fields.get("PreemptTime", "None") != "None" or fields.get("Reason") == "TimeLimit"
    if received not in COMES_BACK and not preempted:
        return None  # scancel: the person meant it
    requeued = scontrol("requeue", job)
    if requeued and requeued.returncode == 0:
        return comes_back
    said = (requeued.stderr.strip() or f"exit {requeued.returncode}") if requeued else "no scontrol"
    log.warning(f"could not requeue SLURM job {job} ({said}): it comes back only when started again")
    return None


def slurm_job() -> str | None:
    """This job's id as `scontrol` takes it (`<array job>_<task>` for a task of an array, as a
    sweep's jobs are), or None outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        task = os.environ["SLURM_ARRAY_TASK_ID"]
        if "SLURM_ARRAY_JOB_ID" not in os.environ:
            raise RunError(
                f"SLURM_ARRAY_TASK_ID={task} is set but SLURM_ARRAY_JOB_ID is not, and a requeue needs both: SLURM "
                f"sets them together for a task of an array job; unset SLURM_ARRAY_TASK_ID, or set both"
            )
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{task}"
    return os.environ["SLURM_JOB_ID"]


def scontrol(*arguments: str) -> subprocess.CompletedProcess | None:
    """`scontrol <arguments>`, or None when it could not run or did not answer in a minute."""
    try:
        return subprocess.run(["scontrol", *arguments], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
