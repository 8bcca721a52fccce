"""The state of one layer's cache in one GPU batch, between the steps that read, load and store it.

A travelling cache's decode step of a layer goes: its disk rows' read, made while the layer before
loads (the schedule's READ_CACHE), the load of its first slots into a workspace set (LOAD_CACHE),
then the attention there, after which its new slot goes home (COMPUTE). Each is a transition of
the layer's :class:`LayerKV`; one out of order raises :class:`KVStateError`, naming the layer and
its state, instead of reading stale slots.

The main thread alone reads and changes the records. What crosses threads and streams are the
handles a record keeps: the futures of the worker's and the readers' jobs, and the events of the
stream copies, each waited for by whoever reads what it writes.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import Enum
from typing import NamedTuple


class Phase(Enum):
    IDLE = "idle"  # no read or load of the layer is in flight
    READ = "read ahead"  # its disk rows' read was made ahead of its load
    LOADED = "loaded"  # its first slots are being copied into a workspace set, for its attention


class Load(NamedTuple):
    """A layer's load into the workspace, as its attention waits for it."""

    index: int  # the workspace set
    ready: object  # event: the copies of its host rows are done (None on the CPU)
    from_disk: Future | None  # the copy of its disk rows once read; its result is the copy's event


class KVStateError(RuntimeError):
    """A cache step out of order: the block's schedule and its cache disagree."""


class LayerKV:
    """One layer's cache state in one GPU batch (see the module's docstring).

    Besides the phase, it keeps the last write to the layer's host rows, by the store stream (an
    event: the next load waits for it on the cache stream) and by the worker (a future: the next
    read of its disk rows waits for it). A write is legal only while no read or load is in flight,
    which would miss it.
    """

    __slots__ = ("layer", "phase", "_read", "_load", "_stored", "_written")

    def __init__(self, layer: int):
        self.layer = layer
        self.phase = Phase.IDLE
        self._read: tuple[int, Future] | None = None  # (the step's first slot, the read) while READ
        self._load: Load | None = None  # while LOADED
        self._stored = None  # the store stream's last write to its host rows (an event)
        self._written: Future | None = None  # the worker's last write to its host rows

    def _expect(self, action: str, *phases: Phase) -> None:
        if self.phase not in phases:
            raise KVStateError(f"layer {self.layer}'s cache cannot {action}: it is {self.phase.value}")

    def read_ahead(self, start: int, read: Future) -> None:
        """IDLE -> READ: ``read`` fills the disk rows' staging pair for the step from slot ``start``."""
        self._expect("be read ahead", Phase.IDLE)
        self.phase, self._read = Phase.READ, (start, read)

    def take_read(self) -> tuple[int, Future] | None:
        """READ -> IDLE, giving (start, read); None where no read was made ahead (IDLE stays)."""
        self._expect("give its read", Phase.IDLE, Phase.READ)
        read, self._read, self.phase = self._read, None, Phase.IDLE
        return read

    def loaded(self, load: Load) -> None:
        """IDLE -> LOADED (a read made ahead is taken first)."""
        self._expect("be loaded", Phase.IDLE)
        self.phase, self._load = Phase.LOADED, load

    def take_load(self) -> Load:
        """LOADED -> IDLE, giving the load that the layer's attention waits for."""
        self._expect("attend on loaded slots (no LOAD_CACHE came for it)", Phase.LOADED)
        load, self._load, self.phase = self._load, None, Phase.IDLE
        return load

    def streamed(self, event) -> None:
        """The store stream has enqueued a write to the layer's host rows (``event`` marks its end)."""
        self._expect("be written", Phase.IDLE)
        self._stored = event

    def wrote(self, job: Future) -> None:
        """The worker's ``job`` writes the layer's host rows."""
        self._expect("be written", Phase.IDLE)
        self._written = job

    def take_stored(self):
        """The event of the store stream's last write not yet waited for (None: none)."""
        stored, self._stored = self._stored, None
        return stored

    def take_written(self) -> Future | None:
        """The worker's last write not yet waited for (None: none)."""
        written, self._written = self._written, None
        return written
