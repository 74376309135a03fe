"""Start-up work at the lowest CPU priority, so that a process that trains keeps its cores while
another starts beside it: a standby leg's imports and its MLflow sender's (standby.py).

Linux lets a thread lower its own priority to SCHED_IDLE, which runs it only on a core nothing else
wants, without privileges, but not raise it again: the work runs in a thread of its own that ends
with it, and the process goes on at its priority. Elsewhere the work runs as it would.
"""

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def lowest(work: Callable[[], T]) -> T:
    """`work()`, done in a thread at the lowest priority; its result, or its exception, here."""

    def idle() -> T:
        with contextlib.suppress(AttributeError, OSError):  # not Linux: at the process's priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread only
        return work()

    with ThreadPoolExecutor(1, thread_name_prefix="lowest-priority") as pool:
        return pool.submit(idle).result()
