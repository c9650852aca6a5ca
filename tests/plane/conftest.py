"""Fixtures the event plane's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZMQ context of the test's own; ``term`` at the end waits for every socket made from it to be
    closed, so a test that leaves one open hangs instead of passing."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()
