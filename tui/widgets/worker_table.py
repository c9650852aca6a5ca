"""The worker table: one row per (worker, dp rank), updated in place every refresh.

Rows keep their key (``"<worker>:<dp>"``) for the life of the worker and change through ``update_cell``,
so the cursor, the scroll position and a detail view opened on a row survive every refresh; only workers
that appear or leave (or a filter) add or remove rows. ``DataTable.clear()`` plus re-adding, the obvious
alternative, resets the cursor each tick (spec §4.2). Order comes from ``DataTable.sort`` with a rank
this module computes from the data, not from the rendered cells, so ``cached`` sorts by number and ties
fall back to the worker id.

Two column sets: the full one of spec §4.1 when the terminal is wide enough for it, and a narrow one
that fits 80 columns (no cost breakdown, no prefill, worker and dp in one column). The terms shown
(overlap, pred and costs, p(select)) are each worker's in the last explained decision, or the pinned probe's.

``cached`` is the device tier's blocks, the ones routing credits most. When some worker holds blocks in
the host, disk or shared tier, the set gains a column per such tier after ``Δcached/s``, or, if those do
not fit, one ``other`` column summing them; if not even that fits, none (the detail screen lists every
tier). The narrow set takes 78 of 80 columns, so at 80 columns no tier column is shown: ``other`` needs 8
(86 columns), and shrinking the narrow set's other columns to make room was rejected (state names and
counts are already at their shortest). A tier no worker holds gets no column, so a fleet without
offloading sees the same table as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import DataTable

from tui import cells
from tui.model import TIERS, Candidate, Decision, ProbeRow, Snapshot, WorkerRow
from tui.rates import Rates
from tui.view import View

__all__ = [
    "COLUMNS",
    "TIER_COLUMNS",
    "Column",
    "Line",
    "WorkerTable",
    "build_lines",
    "choose_columns",
    "has_roles",
    "held_tiers",
    "row_key",
]

MARK: Final = "▶"
"""Marks the worker the last decision chose."""


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    label: str
    width: int
    narrow: bool
    """Also in the 80-column set."""
    numeric: bool = True


COLUMNS: Final = (
    Column("worker", "worker", 8, True, numeric=False),
    Column("state", "state", 11, True, numeric=False),
    Column("cached", "cached", 7, True),
    Column("delta", "Δcached/s", 9, True),
    Column("active", "active", 7, True),
    Column("prefill", "prefill", 7, False),
    Column("reqs", "reqs", 5, True),
    Column("overlap", "overlap", 7, True),
    Column("pred", "pred", 5, False),
    Column("prefill_cost", "prefill_cost", 12, False),
    Column("decode_cost", "decode_cost", 11, False),
    Column("req_cost", "req_cost", 8, False),
    Column("cost", "cost", 8, True),
    Column("p", "p(select)", 9, False),
    Column("last_event", "last event", 10, True),
    Column("gaps", "gaps", 4, True),
)
"""The full set, in screen order (spec §4.1)."""

_NARROW: Final = {
    "worker": 6,
    "state": 9,
    "cached": 6,
    "delta": 6,
    "active": 6,
    "reqs": 4,
    "overlap": 4,
    "cost": 6,
    "last_event": 6,
}
"""Tighter widths for the narrow set; numbers past them are shortened by ``cells.count`` (``12.3k``)."""

_NARROW_LABELS: Final = {"delta": "Δ/s", "overlap": "ovl", "last_event": "last"}

ROLE_COLUMN: Final = Column("role", "role", 7, True, numeric=False)
"""``prefill``, ``decode`` or ``both``: shown only for a fleet with roles (``choose_columns``)."""

TIER_COLUMNS: Final = {tier: Column(tier, tier, 7, True) for tier in TIERS[1:]} | {
    "other": Column("other", "other", 7, True)
}
"""Cached blocks in one slower tier each, and ``other``, their sum: the columns ``choose_columns`` adds
after ``delta`` for the tiers some worker holds (``held_tiers``). Narrow, they are 6 wide like ``cached``."""


SCROLLBAR: Final = 1
"""The table's vertical scrollbar (``top.tcss``), which the columns must leave room for."""


def held_tiers(workers: Sequence[WorkerRow]) -> tuple[str, ...]:
    """The tiers slower than device in which some worker holds blocks, in ``TIERS`` order."""
    return tuple(tier for i, tier in enumerate(TIERS[1:]) if any(row.cached_offloaded[i] for row in workers))


def choose_columns(
    width: int, *, with_p: bool, worker_chars: int = 0, tiers: Sequence[str] = (), roles: bool = False
) -> tuple[Column, ...]:
    """The full set if it fits ``width`` (2 cells of padding a column), else the narrow one (78 cells);
    each with a column per tier of ``tiers`` if they fit, else with one ``other`` column if it fits; and
    with ``role`` after ``state`` (``roles``: a disaggregated fleet) in the full set, and in the narrow one
    when it fits.

    Args:
        width: The table's width in cells.
        with_p: Show p(select) (the softmax temperature is above 0).
        worker_chars: The longest worker cell; the worker column grows to it (worker ids from a
            registration can be long), which may push the narrow set past 80 columns.
        tiers: The slower tiers some worker holds blocks in (``held_tiers``); none adds no column.
        roles: Some worker's role is not ``both`` (``has_roles``); else no role column, as before roles.
    """
    width -= SCROLLBAR
    full = tuple(
        replace(column, width=max(column.width, worker_chars)) if column.key == "worker" else column
        for column in COLUMNS
        if with_p or column.key != "p"
    )
    if roles:
        at = next(i for i, column in enumerate(full) if column.key == "state") + 1
        full = (*full[:at], ROLE_COLUMN, *full[at:])
    narrow = tuple(
        replace(
            column,
            label=_NARROW_LABELS.get(column.key, column.label),
            width=max(_NARROW.get(column.key, column.width), worker_chars if column.key == "worker" else 0),
        )
        for column in full
        if column.narrow
    )
    extras: list[tuple[Column, ...]] = (
        [tuple(TIER_COLUMNS[t] for t in tiers), (TIER_COLUMNS["other"],)] if tiers else [()]
    )
    plain = tuple(column for column in narrow if column.key != "role")
    for base, cell_width in ((full, None), (narrow, _NARROW["cached"]), (plain, _NARROW["cached"])):
        for extra in extras:
            shown = _with_tiers(base, extra, cell_width)
            if sum(column.width + 2 for column in shown) <= width:
                return shown
    return plain


def has_roles(workers: Sequence[WorkerRow]) -> bool:
    """Whether the fleet is disaggregated enough to show roles: some worker is not ``both``."""
    return any(row.role != "both" for row in workers)


def _with_tiers(base: tuple[Column, ...], extra: tuple[Column, ...], width: int | None) -> tuple[Column, ...]:
    """``base`` with the tier columns ``extra`` after ``delta`` (``width`` wide, when given)."""
    if width is not None:
        extra = tuple(replace(column, width=width) for column in extra)
    at = next(i for i, column in enumerate(base) if column.key == "delta") + 1
    return (*base[:at], *extra, *base[at:])


def row_key(key: tuple[int, int]) -> str:
    return f"{key[0]}:{key[1]}"


@dataclass(frozen=True, slots=True)
class Line:
    """One table row ready to show: its cells by column key, and the values it sorts by."""

    key: str
    cells: dict[str, Text]
    sort_values: dict[str, float]


def last_explained(decisions: Sequence[Decision]) -> Decision | None:
    """The newest decision that carries every candidate's terms."""
    return next((decision for decision in reversed(decisions) if decision.candidates), None)


def _shift(values: Iterable[float], normalised: bool) -> Callable[[float | None], float | None]:
    """Raw costs, or minus the lowest of them (``t``); unknown stays unknown."""
    lowest = min(values, default=0.0) if normalised else 0.0
    return lambda value: None if value is None else value - lowest


def build_lines(snapshot: Snapshot, rates: Rates, view: View, probe_rows: Sequence[ProbeRow] = ()) -> list[Line]:
    """Every worker's row, filtered and sorted as the view says (sorting is by the ``Line`` order)."""
    explained = last_explained(snapshot.decisions)
    terms: dict[tuple[int, int], Candidate] = {}
    if explained is not None and view.probe is None:
        terms = {(candidate.worker_id, candidate.dp_rank): candidate for candidate in explained.candidates}
    probed = {(row.worker_id, row.dp_rank): row for row in probe_rows} if view.probe is not None else {}
    shown = explained if terms else (snapshot.decisions[-1] if snapshot.decisions else None)
    chosen = (shown.worker_id, shown.dp_rank) if shown is not None else None  # the winner of the terms shown

    prefill_shift = _shift((c.prefill_cost for c in terms.values()), view.normalised)
    decode_shift = _shift((float(c.decode_blocks) for c in terms.values()), view.normalised)
    request_shift = _shift((c.request_cost for c in terms.values()), view.normalised)
    totals = [c.total for c in terms.values()] + [p.total for p in probed.values()]
    total_shift = _shift(totals, view.normalised)

    lines = []
    needle = view.filter.lower()
    for row in snapshot.workers:
        name = row_key(row.key)
        if needle and needle not in f"{name} {row.state} {row.model} {row.role}".lower():
            continue
        candidate = terms.get(row.key)
        probe = probed.get(row.key)
        overlap = probe.overlap_blocks if probe else candidate.overlap_blocks if candidate else None
        predicted = probe.predicted_blocks if probe else candidate.predicted_blocks if candidate else None
        total = probe.total if probe else candidate.total if candidate else None
        delta = rates.cached.get(row.key)
        prefill_term = None if candidate is None else candidate.prefill_cost
        decode_term = None if candidate is None else float(candidate.decode_blocks)
        request_term = None if candidate is None else candidate.request_cost
        last_event_age = None if row.last_event_at is None else snapshot.taken_at - row.last_event_at
        marker = MARK if row.key == chosen else " "
        line_cells = {
            "worker": Text(f"{marker}{name}"),
            "state": cells.state(row.state),
            "role": Text(row.role),
            "cached": cells.number(row.cached_blocks),
            "delta": cells.number(cells.signed_rate(delta)),
            **{tier: cells.number(count) for tier, count in zip(TIERS[1:], row.cached_offloaded, strict=True)},
            "other": cells.number(sum(row.cached_offloaded)),
            "active": cells.number(row.active_blocks),
            "prefill": cells.number(row.prefill_tokens),
            "reqs": cells.number(row.requests),
            "overlap": cells.number(overlap),
            "pred": cells.number(predicted),
            "prefill_cost": cells.number(cells.cost(prefill_shift(prefill_term))),
            "decode_cost": cells.number(cells.cost(decode_shift(decode_term))),
            "req_cost": cells.number(cells.cost(request_shift(request_term))),
            "cost": cells.number(
                cells.cost(total_shift(total)),
                style="bold" if (probe and probe.busy) or (candidate and candidate.busy) else "",
            ),
            "p": cells.number(None if candidate is None else f"{candidate.probability:.2f}"),
            "last_event": cells.number(cells.age(row.last_event_at, snapshot.taken_at)),
            "gaps": cells.number(row.gaps_detected, style="red" if row.gaps_lost else ""),
        }
        lines.append(Line(name, line_cells, _sort_values(row, delta, overlap, total, last_event_age)))
    return lines


def _sort_values(
    row: WorkerRow, delta: float | None, overlap: int | None, total: float | None, last_event_age: float | None
) -> dict[str, float]:
    """Each sort key's value, oriented so that ascending is the natural order (biggest first for
    amounts, cheapest first for cost, most recent first for the last event); unknowns sort last."""
    unknown = float("inf")
    return {
        "worker": row.worker_id * 65536 + row.dp_rank,
        "cached": -row.cached_blocks,
        "delta": unknown if delta is None else -delta,
        "active": -row.active_blocks,
        "prefill": -row.prefill_tokens,
        "reqs": -row.requests,
        "overlap": unknown if overlap is None else -overlap,
        "cost": unknown if total is None else total,
        "last_event": unknown if last_event_age is None else last_event_age,
    }


def _same(shown: Text, new: Text) -> bool:
    """Whether a cell would look the same: every ``update_cell`` invalidates the table's render cache,
    so unchanged cells are left alone (``Text.__eq__`` ignores the style, which carries state colour)."""
    return shown.plain == new.plain and shown.style == new.style and shown.spans == new.spans


class WorkerTable(DataTable[Text]):
    """The worker rows; :meth:`show` makes the table match a list of :class:`Line`."""

    class Resized(Message):
        """The table's width changed: the app picks the column set again."""

    def on_resize(self, event: events.Resize) -> None:
        self.post_message(self.Resized())

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self.heading: tuple[tuple[Column, ...], str, bool] = ((), "", False)
        """The columns shown and the sort they are labelled with."""

    def show(self, lines: Sequence[Line], columns: tuple[Column, ...], view: View) -> None:
        """Match the table to ``lines``: update cells in place, add and remove rows, then sort."""
        heading = (columns, view.sort_key, view.sort_reverse)
        restore = self._set_columns(*heading) if heading != self.heading else None
        wanted = {line.key: line for line in lines}
        for key in [key for key in self.rows if key.value not in wanted]:
            self.remove_row(key)
        for line in lines:
            values = [line.cells[column.key] for column in columns]
            if line.key in self.rows:
                for column, value in zip(columns, values, strict=True):
                    if not _same(self.get_cell(line.key, column.key), value):
                        self.update_cell(line.key, column.key, value)
            else:
                self.add_row(*values, key=line.key)
        rank = {
            line.cells["worker"].plain: index
            for index, line in enumerate(
                sorted(
                    lines,
                    key=lambda line: (line.sort_values[view.sort_key], line.sort_values["worker"]),
                    reverse=view.sort_reverse,
                )
            )
        }
        self.sort("worker", key=lambda cell: rank[cell.plain])
        if restore is not None and restore in self.rows:
            self.move_cursor(row=self.get_row_index(restore))

    def _set_columns(self, columns: tuple[Column, ...], sort_key: str, sort_reverse: bool) -> str | None:
        """New columns or a new sort (the terminal was resized, T went above 0, ``s`` was pressed):
        rebuild the heading, the sorted column marked ▼ (its natural order) or ▲ (reversed). Returns
        the row key the cursor was on, for :meth:`show` to put it back once the rows are in again.
        Rare (a key or a resize), so rebuilding beats reaching into the table's column cache."""
        cursor_key = self.cursor_key
        self.clear(columns=True)
        for column in columns:
            label = column.label
            if column.key == sort_key:
                label += "▲" if sort_reverse else "▼"
            heading = Text(label, justify="right") if column.numeric else Text(label)
            self.add_column(heading, width=max(column.width, len(label)), key=column.key)
        self.heading = (columns, sort_key, sort_reverse)
        return cursor_key

    @property
    def cursor_key(self) -> str | None:
        """The row key under the cursor, if any."""
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
