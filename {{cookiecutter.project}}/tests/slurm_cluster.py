"""A real single-node SLURM cluster for the tests marked `slurm`: munge, MariaDB, slurmdbd,
slurmctld and slurmd, started by hand in a folder of their own (no systemd needed) and stopped by
PID after. Accounting is on because submitit asks `sacct` how a job ended; without it a job that
ends without a result is UNKNOWN and its sweep waits forever.

Three partitions on the one node give real preemption: a job in `low` (no grace time) or `grace`
(60 s between SIGTERM and SIGKILL) is requeued when a job of `high` needs its cores."""

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server"]
DAEMONS = ["munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"]
NAME = "continuum"

SLURM_CONF = """
ClusterName={name}
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
# A requeued job may start again 10 s after it ended, not 121 s (the credential's default life).
AuthInfo=cred_expire=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
KillWait=30
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=low Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=0
PartitionName=grace Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=high Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""

SLURMDBD_CONF = """
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={folder}/slurmdbd.pid
LogFile={folder}/slurmdbd.log
"""


def unavailable() -> str | None:
    """Why a cluster cannot be started here, or None when it can (installing what is missing)."""
    if os.geteuid() != 0:
        return "starting SLURM's daemons needs root"
    if all(shutil.which(daemon, path="/usr/sbin:/usr/bin:/sbin") for daemon in DAEMONS):
        return None
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed and there is no apt-get to install it ({' '.join(PACKAGES)})"
    installed = subprocess.run(
        ["apt-get", "install", "-y", "-q", *PACKAGES],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        capture_output=True,
        text=True,
    )
    if installed.returncode != 0:
        return f"apt-get could not install SLURM: {installed.stderr.strip().splitlines()[-1:]}"
    return None


class Cluster:
    """The cluster's daemons, with their configuration, state and logs in a folder of its own
    (one MariaDB's user may enter: not under pytest's, which only root may), removed at `stop`;
    `env` is what a client (sbatch, sacct, submitit) needs to find it."""

    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="slurm-cluster-"))
        folder.chmod(0o755)
        self.folder, self.cpus = folder, os.cpu_count() or 1
        self.env = {
            **os.environ,
            "SLURM_CONF": str(folder / "slurm.conf"),
            "MYSQL_UNIX_PORT": str(folder / "mysql" / "mysql.sock"),
        }
        self._started: list[tuple[str, int]] = []

    def start(self) -> None:
        folder = self.folder
        for sub in ("state", "spool", "mysql"):
            (folder / sub).mkdir()
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        settings = {"name": NAME, "folder": folder, "cpus": self.cpus, "memory_mb": memory_mb // 2}
        (folder / "slurm.conf").write_text(SLURM_CONF.format(**settings))
        dbd_conf = folder / "slurmdbd.conf"
        dbd_conf.write_text(SLURMDBD_CONF.format(**settings))
        dbd_conf.chmod(0o600)

        self._munge()
        self._mariadb()
        self._daemon("slurmdbd", ["slurmdbd"], folder / "slurmdbd.pid")
        self.until(lambda: self.run("sacctmgr", "-n", "list", "cluster", check=False).returncode == 0, "slurmdbd")
        self.run("sacctmgr", "-i", "add", "cluster", NAME, check=False)  # already there on a second start
        self._daemon("slurmctld", ["slurmctld"], folder / "slurmctld.pid")
        self._daemon("slurmd", ["slurmd", "-N", "localhost"], folder / "slurmd.pid")
        self.until(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", "-p", "low", check=False).stdout, "slurmd")

    def stop(self) -> None:
        """Cancels the jobs left (a test that failed may leave one running, whose job step would
        outlive the daemons and report to the next cluster's slurmctld as its job of the same id),
        waits for them to end, then stops every daemon this cluster started, newest first, and
        waits for each to end."""
        if any(name == "slurmctld" for name, _ in self._started):
            self.run("scancel", f"--user={getpass.getuser()}", check=False)
            self.until(lambda: not self.run("squeue", "--noheader", check=False).stdout.strip(), "the jobs to end")
        for name, pid in reversed(self._started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            self.until(lambda pid=pid: not alive(pid), f"{name} to stop")
        self._started.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        result = subprocess.run(command, env=self.env, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
        return result

    def until(self, condition, what: str, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
        """Waits for `condition()` while a daemon starts or stops; fails with the logs if `process`
        (when given) ends first, or after five minutes, the bound of a machine too busy to test on."""
        deadline = time.monotonic() + 300
        while not condition():
            if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
                logs = [log] if log else sorted(self.folder.glob("*.log"))
                said = "\n".join(f"{path.name}:\n{path.read_text()[-2000:]}" for path in logs if path.exists())
                raise RuntimeError(f"{what}: did not happen\n{said}")
            time.sleep(0.1)

    def _daemon(self, name: str, command: list[str], pid_file: Path, **popen) -> None:
        """Starts a daemon that forks into the background and writes `pid_file`."""
        pid_file.unlink(missing_ok=True)
        subprocess.run(command, env=self.env, check=True, **popen)
        self.until(lambda: pid_file.exists() and pid_file.read_text().strip(), f"{name} to start")
        self._started.append((name, int(pid_file.read_text())))

    def _munge(self) -> None:
        pid_file = Path("/run/munge/munged.pid")
        if pid_file.exists() and alive(int(pid_file.read_text() or 0)):
            return  # the machine's own munge, left as it is
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        self._daemon("munged", ["runuser", "-u", "munge", "--", "munged"], pid_file)

    def _mariadb(self) -> None:
        data = self.folder / "mysql"  # its socket, PID file and log too: the folder mariadbd may write
        shutil.chown(data, "mysql", "mysql")
        self.run("mariadb-install-db", "--user=mysql", f"--datadir={data}", "--auth-root-authentication-method=socket")
        server = subprocess.Popen(
            ["mariadbd", "--user=mysql", f"--datadir={data}", f"--socket={data / 'mysql.sock'}", "--skip-networking",
             f"--pid-file={data / 'mariadb.pid'}", f"--log-error={data / 'mariadb.log'}"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.until(lambda: (data / "mysql.sock").exists(), "mariadbd to start", server, data / "mariadb.log")
        self._started.append(("mariadbd", server.pid))


def alive(pid: int) -> bool:
    """Whether `pid` runs (an ended child of this process is reaped, and a zombie counts as ended)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
