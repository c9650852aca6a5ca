"""The demo's workload: a share of sessions that open with a long fresh document, and none by default."""

from __future__ import annotations

from kvrouter.demo.workload import Workload


def test_documents_open_a_share_of_sessions_and_change_nothing_when_off():
    plain, again = Workload(7, 16), Workload(7, 16, documents=0.0)
    for _ in range(20):  # off: the same sessions and turns as a workload made without the option
        a, b = plain.session(), again.session()
        assert (a.system, a.turns_left, plain.turn(a)) == (b.system, b.turns_left, again.turn(b))
    always = Workload(7, 16, documents=1.0)
    for _ in range(10):
        session = always.session()
        document = len(session.history)
        assert 3000 <= document <= 5000
        prompt, _ = always.turn(session)
        assert len(prompt) > document  # the system prompt, the document, then the user's turn
