"""The dashboard's widgets, one per module; their look beyond intrinsic sizing is in ``top.tcss``."""

from tui.widgets.decision_log import DecisionLog as DecisionLog
from tui.widgets.event_log import EventLog as EventLog
from tui.widgets.meters import Meters as Meters
from tui.widgets.rate_strip import RateStrip as RateStrip
from tui.widgets.worker_table import WorkerTable as WorkerTable

__all__ = ["DecisionLog", "EventLog", "Meters", "RateStrip", "WorkerTable"]
