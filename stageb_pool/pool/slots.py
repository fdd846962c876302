"""The parent's view of each worker of a process pool; the dispatcher moves its states.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import NamedTuple

from .shared import SharedCache
from .tasks import TaskHandle


class WorkerState(enum.Enum):
    SPAWNING = "spawning"  # asked for; no process reported yet (start_timeout)
    STARTING = "starting"  # its process builds the engine (start_timeout)
    IDLE = "idle"
    BUSY = "busy"  # tasks in flight; the first is running (task_timeout)
    LOST = "lost"  # its channel closed; the exit report is due (EXIT_REPORT_GRACE)
    KILLED = "killed"  # killed by the pool; the exit report is due (KILL_REPORT_TIMEOUT)
    DEAD = "dead"  # exit reported


class Trouble(NamedTuple):  # the first sign that a worker is failing: its state then, the limit it exceeded
    during: WorkerState
    timeout: float | None


class Earliest:
    """A lower bound of every slot's deadline and next stall warning, lowered by ``Slot``'s setters
    and recomputed by the dispatcher once it passes: the slots are scanned only when one is due."""

    __slots__ = ("at",)

    def __init__(self):
        self.at: float | None = None

    def lower(self, t: float | None) -> None:
        if t is not None and (self.at is None or t < self.at):
            self.at = t


class Slot:
    """The parent's view of the worker of one rank (one process; a replacement gets a new Slot)."""

    def __init__(self, rank: int, device, deadline: float | None, earliest: Earliest | None = None):
        self.rank, self.device = rank, device
        self.earliest = earliest or Earliest()
        self.state = WorkerState.SPAWNING
        self.deadline = deadline  # of the current state; None: no limit
        self.pid: int | None = None
        self.tasks: deque[TaskHandle] = deque()  # in flight, in the order the worker runs them
        self.started = 0.0  # when the running task (the first) started, as far as we know
        self.next_warning: float | None = None  # when the running task's silence is next reported
        self.trouble: Trouble | None = None
        self.cache = SharedCache()

    @property
    def deadline(self) -> float | None:
        return self._deadline

    @deadline.setter
    def deadline(self, t: float | None) -> None:
        self._deadline = t
        if t is not None:
            self.earliest.lower(t)

    @property
    def next_warning(self) -> float | None:
        return self._next_warning

    @next_warning.setter
    def next_warning(self, t: float | None) -> None:
        self._next_warning = t
        if t is not None:
            self.earliest.lower(t)

    @property
    def task(self) -> TaskHandle | None:
        return self.tasks[0] if self.tasks else None

    def where(self) -> dict:
        """The keyword arguments that locate a fault of this worker in an error."""
        task = self.task
        starting = self.trouble is not None and self.trouble.during is WorkerState.STARTING
        return dict(rank=self.rank, device=self.device.name, index=task.index if task else None,
                    method=task.method if task else ("engine_factory" if starting else None))
