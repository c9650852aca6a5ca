"""``Reservations``: the requests this service booked, until their first token, their end or their expiry.

A reservation is a decision booked on its worker (``/select_and_reserve``): its prompt counts as that
worker's queued prefill until ``prefill_complete``, and its blocks as active until it is freed. This
replica's own bookings live here; with replica sync on, the peers' are in each partition's slot manager
(the sync applied them), and any replica may complete or free any reservation, so a load balancer need
not be sticky. A completion or free can outrun the peer's booking on its way (a balancer sending the next
call to another replica at once): :meth:`Reservations.hear_of` waits up to :data:`SYNC_GRACE_S` for it.

Every slot-manager change goes through here, so ``--record`` holds its clock around it (the recording
replays each at the time it was made). :class:`ReplicaHost` is what the replica sync calls back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from ...errors import NotFound
from ...events.model import WorkerKey
from ...routing import Selection
from ...routing.disagg import PREFILL_BOOKING
from ...routing.slots import SlotManager
from .partition import Partition
from .registry import Registry

if TYPE_CHECKING:
    from .accuracy import Accuracy
    from .predictions import Predictions
    from .recording import ServiceRecording

__all__ = ["SYNC_GRACE_S", "SYNC_POLL_S", "ReplicaHost", "Reservation", "Reservations"]

log = logging.getLogger(__name__)

SYNC_GRACE_S: Final = 0.5
"""How long ``prefill_complete`` and ``free`` wait, with replica sync connected, for a reservation this
replica (or front) has not heard of yet before answering 404. Its booking travels from the replica that
made it over NATS or the local bus (milliseconds, tens on a loaded machine), while a client behind a load
balancer that is not sticky may send its next call to another replica at once: without the wait that call
was refused, and the reservation's prefill stayed counted on every replica."""
SYNC_POLL_S: Final = 0.005
"""How often :meth:`Reservations.hear_of` looks again. A poll, not a wake-up from the sync's callback: the
wait is rare and bounded, and a poll keeps no waiters to clean up when a booking never comes."""


@dataclass(slots=True)
class Reservation:
    partition: Partition
    worker: WorkerKey
    at: float
    """``time.monotonic()`` when booked."""
    predicted: int | None = None
    """The chosen worker's predicted overlap in tokens (own reservations; a peer's is not known here)."""
    reported: bool = False
    """The engine's reuse was reported (``accuracy.py``): one report per reservation."""


class Reservations:
    """This service's bookings; see the module docstring. The event loop is its one user."""

    def __init__(
        self,
        registry: Registry,
        accuracy: Accuracy,
        predictions: Predictions,
        *,
        recording: ServiceRecording | None = None,
    ) -> None:
        self.registry = registry
        self.accuracy = accuracy
        self.predictions = predictions
        """The predicted tier's bets on own reservations, settled as they end (``predictions.py``)."""
        self.recording = recording
        self.own: dict[str, Reservation] = {}
        """This replica's bookings, oldest first."""
        self.changed: Callable[[Partition], None] = lambda _partition: None
        """Called after a booking's load changes (the router queue retries its waiters)."""
        self.stopping: Callable[[], bool] = lambda: False
        self._heard_late = False

    def __len__(self) -> int:
        return len(self.own)

    def book(
        self,
        selection_id: str,
        partition: Partition,
        selection: Selection,
        local: npt.NDArray[np.uint64],
        *,
        split: bool = False,
    ) -> None:
        """A decision booked on its worker (the router's slot manager holds its load already); one credited
        blocks in flight there is a bet too (``predictions.py``), settled when the reservation ends. A split
        request's prefill booking (``<id>#prefill``) is the slot manager's, found there when the hop ends.
        A split request keeps no prediction: its decode engine reports the KV it pulled as cached, which no
        index predicts, so its reuse report (the proxy's or a gateway's) compares nothing."""
        worker, device = selection.worker, selection.overlap_blocks
        predicted = None if split else device * partition.block_size
        self.own[selection_id] = Reservation(partition, worker, time.monotonic(), predicted)
        if selection.predicted_blocks:
            self.predictions.made(selection_id, worker, local, device + selection.predicted_blocks)

    def prefill_complete(self, selection_id: str, cached_tokens: int | None = None) -> None:
        """The reservation's first token is out: its prompt stops counting as queued prefill. ``cached_tokens``:
        the prompt tokens the engine reused, when the client knows them (:meth:`report_reuse`).

        Raises:
            NotFound: no such reservation.
        """
        if cached_tokens is not None:
            self.report_reuse(selection_id, cached_tokens)
        reservation = self.own.get(selection_id) or self._peer(selection_id)
        if reservation is None:
            raise NotFound(f"reservation {selection_id!r} not found")
        self._end_prefill_hop(reservation.partition, selection_id)  # a split request's: the prefill worker's part
        self._held("pc", selection_id, lambda: reservation.partition.slots.mark_prefill_completed(selection_id))
        peers = self.registry.peers
        if peers is not None:
            peers.prefill_completed(selection_id, reservation.worker)
        self.changed(reservation.partition)

    def free(self, selection_id: str) -> None:
        """The reservation's request ended: take its load back.

        Raises:
            NotFound: no such reservation (never booked, already freed or expired).
        """
        reservation = self.own.pop(selection_id, None) or self._peer(selection_id)
        if reservation is None:
            raise NotFound(f"reservation {selection_id!r} not found")
        self.predictions.freed(selection_id)
        self._end_prefill_hop(reservation.partition, selection_id)
        self.free_booked(reservation.partition, selection_id)
        peers = self.registry.peers
        if peers is not None:
            peers.freed(selection_id, reservation.worker)
        self.changed(reservation.partition)

    def end_prefill_hop(self, selection_id: str) -> None:
        """A split request's prefill hop answered (the proxy): its prefill worker's booking ends; the decode
        worker's stays until its first token."""
        reservation = self.own.get(selection_id)
        if reservation is not None:
            self._end_prefill_hop(reservation.partition, selection_id)
            self.changed(reservation.partition)

    def _end_prefill_hop(self, partition: Partition, selection_id: str) -> None:
        """A split request's prefill booking ends (its first token, its end or its expiry), here and on the
        peers: whoever booked it, the slot manager holds it under ``<id>#prefill``."""
        booking = selection_id + PREFILL_BOOKING
        booked = partition.slots.booked(booking)
        if booked is None:
            return
        self.free_booked(partition, booking)
        peers = self.registry.peers
        if peers is not None:
            peers.freed(booking, booked.worker)

    def free_booked(self, partition: Partition, selection_id: str) -> None:
        """Take a reservation's load off its partition's slot manager."""
        self._held("free", selection_id, lambda: partition.slots.free(selection_id))

    def report_reuse(self, selection_id: str, cached_tokens: int) -> str | None:
        """The engine reused ``cached_tokens`` of the reservation's prompt: compare with the prediction
        (``accuracy.py``). Returns the outcome, or None when there is nothing to compare with (not booked
        here, already reported, or freed)."""
        reservation = self.own.get(selection_id)
        if reservation is None or reservation.predicted is None or reservation.reported:
            return None
        reservation.reported = True
        block_size = reservation.partition.block_size
        return self.accuracy.observe(reservation.worker, reservation.predicted, cached_tokens, block_size)

    def expire(self, expiry_secs: float) -> list[tuple[str, Reservation]]:
        """Drop own reservations older than ``expiry_secs`` (their load too); returns them."""
        cutoff = time.monotonic() - expiry_secs
        expired = []
        for selection_id, reservation in list(self.own.items()):
            if reservation.at > cutoff:
                break
            del self.own[selection_id]
            self.predictions.expired(selection_id)
            self._end_prefill_hop(reservation.partition, selection_id)
            self.free_booked(reservation.partition, selection_id)
            expired.append((selection_id, reservation))
        return expired

    def sweep(self, partition: Partition) -> bool:
        """The slot manager's sweep of requests past their expiry; whether it removed any."""
        recording = self.recording
        if recording is None:
            return bool(partition.slots.sweep())
        t = recording.clock.hold()
        try:
            removed = bool(partition.slots.sweep())
        finally:
            recording.clock.release()
        if removed:
            recording.swept(t, partition)
        return removed

    def knows(self, selection_id: str) -> bool:
        """Booked here, or by a peer and applied here."""
        return selection_id in self.own or self._peer(selection_id) is not None

    def awaits_booking(self, selection_id: str) -> bool:
        """A completion or free of this reservation would wait in :meth:`hear_of`: replica sync is connected
        and the reservation is not known here (yet)."""
        peers = self.registry.peers
        return peers is not None and peers.connected and not self.knows(selection_id)

    async def hear_of(self, selection_id: str) -> None:
        """Before completing or freeing a reservation not known here: with replica sync connected, wait up to
        :data:`SYNC_GRACE_S` for a peer's booking of it to arrive (then the call applies as usual, or is
        refused as before). A call for a reservation known here, or with no sync or no connection, goes on
        at once."""
        if not self.awaits_booking(selection_id):
            return
        started = time.monotonic()
        while time.monotonic() - started < SYNC_GRACE_S and not self.stopping():
            await asyncio.sleep(SYNC_POLL_S)
            if self.knows(selection_id):
                if not self._heard_late:
                    self._heard_late = True
                    log.info(
                        "reservation heard of late selection_id=%s waited_ms=%.0f: a call reached this replica "
                        "before the peer's booking did (a balancer that is not sticky); waited (logged once)",
                        selection_id,
                        (time.monotonic() - started) * 1000,
                    )
                return

    def _peer(self, selection_id: str) -> Reservation | None:
        """A reservation another replica booked and the sync applied here."""
        if self.registry.peers is None:
            return None
        for partition in self.registry.partitions.values():
            booked = partition.slots.booked(selection_id)
            if booked is not None:
                return Reservation(partition, booked.worker, time.monotonic())
        return None

    def _held(self, kind: str, selection_id: str, change: Callable[[], object]) -> None:
        """``change`` a slot manager, under the recording's held clock when recording."""
        recording = self.recording
        if recording is None:
            change()
            return
        t = recording.clock.hold()
        try:
            change()
        finally:
            recording.clock.release()
        recording.booked(kind, t, selection_id)


class ReplicaHost:
    """What the replica sync calls back (``bridge/sync.py``'s ``SyncHost``): the registered workers' slot
    managers and this replica's own bookings."""

    def __init__(self, registry: Registry, reservations: Reservations) -> None:
        self._registry = registry
        self._reservations = reservations

    def slots_of(self, worker: WorkerKey) -> SlotManager | None:
        """The slot manager of the registered worker's partition; None when not registered."""
        partition = self._registry.owner(worker)
        return None if partition is None else partition.slots

    def all_slots(self) -> Iterator[SlotManager]:
        return (partition.slots for partition in self._registry.partitions.values())

    def own_requests(self) -> Collection[str]:
        """The reservations this replica booked and still holds (a re-sync announces them to peers)."""
        return self._reservations.own.keys()

    def synced(self, worker: WorkerKey, request_id: str, kind: str) -> None:
        """A peer changed ``worker``'s load: waiters may fit now; a peer's Free of one of ours ends ours."""
        if kind == "Free":
            self._reservations.own.pop(request_id, None)
        partition = self._registry.owner(worker)
        if partition is not None:
            self._reservations.changed(partition)
