"""``Wakes`` against real ZMQ sockets: the rules its docstring states, and the libzmq behaviour they rest on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvrouter.plane.wakes import Wakes

WAIT_MS = 2000


@pytest.fixture
def wakes() -> Iterator[Wakes]:
    made = Wakes()
    yield made
    made.close()


def pair(context: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A PUSH bound on a free TCP port and the PULL connected to it."""
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(f"tcp://127.0.0.1:{port}")
    return push, pull


@pytest.fixture
def ends(
    context: zmq.Context[zmq.Socket[bytes]], wakes: Wakes
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """One :func:`pair`; at the end its PULL is unwatched (whether or not the test watched it) and both close."""
    push, pull = pair(context)
    yield push, pull
    wakes.unwatch(pull)
    push.close()
    pull.close()


def settle(wakes: Wakes) -> None:
    """Hand out what a fresh watch hands out, and read nothing: the next poll reports news only."""
    for socket in wakes.poll(0):
        with pytest.raises(zmq.Again):
            socket.recv(zmq.NOBLOCK)


def test_a_message_wakes_its_socket_and_only_it(context: zmq.Context[zmq.Socket[bytes]], wakes: Wakes):
    pairs = [pair(context) for _ in range(40)]
    try:
        for _, pull in pairs:
            wakes.watch(pull)
        settle(wakes)
        assert wakes.poll(0) == []
        push, pull = pairs[17]
        push.send(b"x")
        assert wakes.poll(WAIT_MS) == [pull]
        assert pull.recv(zmq.NOBLOCK) == b"x"
        with pytest.raises(zmq.Again):
            pull.recv(zmq.NOBLOCK)
        assert wakes.poll(0) == []  # read to the end: quiet until the next message
    finally:
        for push, pull in pairs:
            wakes.unwatch(pull)
            push.close()
            pull.close()


def test_a_socket_left_with_messages_comes_back_only_when_said(ends: tuple[zmq.Socket[bytes], ...], wakes: Wakes):
    push, pull = ends
    wakes.watch(pull)
    settle(wakes)
    for n in range(3):
        push.send(b"%d" % n)
    assert wakes.poll(WAIT_MS) == [pull]
    time.sleep(0.05)  # all three arrived
    assert pull.recv(zmq.NOBLOCK) == b"0"  # a drain bound of one
    assert wakes.poll(0) == []  # libzmq tells of the queue once: the two left wake nobody
    wakes.again(pull)
    assert wakes.poll(0) == [pull]
    assert [pull.recv(zmq.NOBLOCK), pull.recv(zmq.NOBLOCK)] == [b"1", b"2"]


def test_a_socket_is_handed_out_once_when_watched(context: zmq.Context[zmq.Socket[bytes]], wakes: Wakes):
    """A recovery DEALER sends its request before it is watched: its reply comes with no notice (the
    connection's first messages never have one), and is read all the same."""
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send(b"ask")
        assert router.poll(WAIT_MS)
        peer, question = router.recv_multipart()
        router.send_multipart([peer, b"answer to " + question])
        time.sleep(0.05)
        wakes.watch(dealer)
        assert wakes.poll(0) == [dealer]
        assert dealer.recv(zmq.NOBLOCK) == b"answer to ask"
        with pytest.raises(zmq.Again):
            dealer.recv(zmq.NOBLOCK)
        assert wakes.poll(0) == []
        dealer.send(b"again")  # read to the end now: the next reply comes with its notice
        assert router.poll(WAIT_MS)
        peer, question = router.recv_multipart()
        router.send_multipart([peer, b"answer to " + question])
        assert wakes.poll(WAIT_MS) == [dealer]
        assert dealer.recv(zmq.NOBLOCK) == b"answer to again"
    finally:
        wakes.unwatch(dealer)
        dealer.close()
        router.close()


def test_an_unwatched_socket_is_never_handed_out(ends: tuple[zmq.Socket[bytes], ...], wakes: Wakes):
    push, pull = ends
    wakes.watch(pull)
    wakes.again(pull)
    wakes.unwatch(pull)
    wakes.again(pull)  # said of a socket no longer watched: ignored
    push.send(b"x")
    assert pull.poll(WAIT_MS)
    assert wakes.poll(10) == []
    wakes.unwatch(pull)  # twice: nothing


def test_the_wait_ends_at_the_timeout_or_the_message(ends: tuple[zmq.Socket[bytes], ...], wakes: Wakes):
    push, pull = ends
    wakes.watch(pull)
    settle(wakes)
    started = time.monotonic()
    assert wakes.poll(30) == []
    assert time.monotonic() - started >= 0.025
    push.send(b"x")
    assert wakes.poll(WAIT_MS) == [pull]
