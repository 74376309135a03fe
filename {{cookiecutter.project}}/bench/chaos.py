"""How much time does a stop cost? The same run straight, then stopped every N seconds and started
again with `resume=auto` until it finishes, as a spot machine or a preempting scheduler would.

Prints the goodput (the straight run's wall time over the chaotic one's; the straight run is timed
before and after it, which averages out the machine's drift), what each stop cost, and where, from
the two runs' own accounts (their `goodput/*` metrics: the chaotic run's buckets less the straight
run's, a stop); then checks that the chaotic run ended where the straight one did: one MLflow run,
the same final loss, and on the CPU the same weights, bit for bit (exit 1 otherwise).

    python bench/chaos.py [--every 20] [--signal both|term|kill] [--steps 90000] [--standby] [key=value ...]

`both` sends SIGTERM (the run saves, then stops) and SIGKILL (it loses what it trained since its
newest checkpoint) in turn. `--standby` keeps a standby leg, started warm, waiting beside each leg
to take over when it ends (src/{{cookiecutter.package}}/engine/lifecycle/standby.py). The overrides go to both
runs: `device=cuda`, `trainer.compile=true`, `checkpoint.every_s=5`.
"""

import argparse
import contextlib
import itertools
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import torch
from startup import workspace

from {{cookiecutter.package}}.engine.lifecycle import goodput

SIGNALS = {"term": [signal.SIGTERM], "kill": [signal.SIGKILL], "both": [signal.SIGTERM, signal.SIGKILL]}
BUCKETS = (*goodput.BUCKETS, "between_legs")


def command(name: str, steps: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "run.py", f"name={name}", f"trainer.max_steps={steps}", "resume=auto", *overrides]


def straight(work: Path, name: str, steps: int, overrides: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command(name, steps, overrides), cwd=work, check=True, capture_output=True)
    return time.perf_counter() - started


def chaotic(work: Path, steps: int, overrides: list[str], every: float, signals: list, standby: bool) -> tuple:
    """The run's wall time, from its first start to its end, and the signal that stopped each leg but
    the last. With `standby`, each leg after the first is started as a standby (`standby=true`) once
    the leg before it holds the run's home, and takes over when that leg ends."""
    run, home = command("chaos", steps, overrides), work / "checkpoints" / "chaos"
    sent, started = [], time.perf_counter()
    leg, deadline = subprocess.Popen(run, cwd=work, stdout=subprocess.DEVNULL), started + every
    for sig in itertools.cycle(signals):
        spare = None
        if standby and holds(home, leg):
            spare = subprocess.Popen([*run, "standby=true"], cwd=work, stdout=subprocess.DEVNULL)
        try:
            code = leg.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            leg.send_signal(sig)
            code = leg.wait()
            if code not in (0, 128 + sig, -sig):
                sys.exit(f"a leg stopped by {sig.name} exited {code}")
            if code != 0:  # a leg that finished as the signal came is the last
                sent.append(sig)
                leg = spare or subprocess.Popen(run, cwd=work, stdout=subprocess.DEVNULL)
                deadline = time.perf_counter() + every
                continue
        if code != 0:
            sys.exit(f"a leg exited {code} by itself")
        ended = time.perf_counter() - started
        if spare is not None and spare.wait() != 0:  # it takes over a finished run: nothing to train
            sys.exit(f"the standby leg exited {spare.returncode} after the run's end")
        return ended, sent
    raise AssertionError("unreachable")


def holds(home: Path, leg: subprocess.Popen) -> bool:
    """Whether `leg` came to hold the run's home (its lock file names it), rather than end first."""
    while leg.poll() is None:
        with contextlib.suppress(OSError):
            if (home / "run.lock").read_text().startswith(f"PID {leg.pid} "):
                return True
        time.sleep(0.01)
    return False


def final_weights(work: Path, name: str) -> dict:
    newest = max((work / "checkpoints" / name).glob("step_*.pt"))
    return torch.load(newest, map_location="cpu", weights_only=True)["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=20.0, help="seconds each leg runs before it is stopped")
    parser.add_argument("--signal", choices=SIGNALS, default="both")
    parser.add_argument("--steps", type=int, default=90_000)
    parser.add_argument("--standby", action="store_true", help="keep a standby leg waiting to take over")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        subprocess.run(command("warm-up", 1, overrides), cwd=work, check=True, capture_output=True)
        # Straight before and after: the machine's drift over minutes (a few %) is as large as what
        # the stops cost at one a minute, and so is shown, and averaged out.
        before = straight(work, "straight", args.steps, overrides)
        chaos_s, sent = chaotic(work, args.steps, overrides, args.every, SIGNALS[args.signal], args.standby)
        after = straight(work, "straight-after", args.steps, overrides)
        straight_s = (before + after) / 2
        mlflow.set_tracking_uri(f"sqlite:///{work / 'mlflow.db'}")
        found = {name: mlflow.search_runs(search_all_experiments=True, filter_string=f"run_name = '{name}'")
                 for name in ("straight", "chaos")}  # fmt: skip
        weights = [final_weights(work, name) for name in ("straight", "chaos")]
        same = all(torch.equal(a, b) for a, b in zip(*(part.values() for part in weights), strict=True))
    stops = max(len(sent), 1)
    print(f"straight: {straight_s:.1f} s ({before:.1f} s before, {after:.1f} s after); stopped every {args.every:g} s{' with a standby' * args.standby}: "
          f"{chaos_s:.1f} s, {len(sent)} stops "
          f"({', '.join(sorted({sig.name for sig in sent}))})")  # fmt: skip
    print(f"goodput {straight_s / chaos_s:.3f}: {(chaos_s - straight_s) / stops:.2f} s a stop")
    runs = {name: frame.iloc[0] for name, frame in found.items()}
    cost = {bucket: (runs["chaos"][f"metrics.goodput/{bucket}_s"] - runs["straight"][f"metrics.goodput/{bucket}_s"])
            / stops for bucket in BUCKETS}  # fmt: skip
    print(
        f"the runs' own accounts: goodput/fraction {runs['straight']['metrics.goodput/fraction']:.3f} straight, "
        f"{runs['chaos']['metrics.goodput/fraction']:.3f} over {runs['chaos']['metrics.goodput/legs']:.0f} legs; "
        f"a stop: " + ", ".join(f"{bucket} {seconds:+.2f} s" for bucket, seconds in cost.items())
    )
    loss = {name: run["metrics.train/loss"] for name, run in runs.items()}
    print(f"{len(found['chaos'])} MLflow run for the chaotic legs; final train/loss {loss['straight']!r} straight, "
          f"{loss['chaos']!r} chaotic; the weights {'equal' if same else 'differ'}, bit for bit")  # fmt: skip
    if len(found["chaos"]) != 1 or (not same and not torch.accelerator.is_available()):
        sys.exit("the chaotic run did not end where the straight one did")


if __name__ == "__main__":
    main()
