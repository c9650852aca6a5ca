"""The demo's workload: multi-turn chat as OpenAI messages, deterministic from its seed, with shared system
prompts, sessions that grow by each turn and its answer, and (on) sessions opening with a long document."""

from __future__ import annotations

import itertools

from kvrouter.chat import DEMO_MODEL, ChatModel, checked_messages
from kvrouter.demo.workload import SYSTEM_PROMPTS, Workload, vocabulary


def test_the_vocabulary_is_whole_words_of_the_demo_model():
    words = vocabulary()
    assert len(words) > 300
    assert words == sorted(words)
    model = ChatModel.from_directory("demo", DEMO_MODEL)
    assert all(len(model.encode(" " + word)) == 1 for word in words[:50])  # one token each, after a space


def test_sessions_share_system_prompts_and_grow_by_each_turn_and_its_answer():
    first, again = Workload(7), Workload(7)
    assert first.system_prompts == again.system_prompts  # deterministic from the seed
    assert len(first.system_prompts) == SYSTEM_PROMPTS
    session = first.session()
    turns = []
    while session.turns_left:
        messages, max_tokens = first.turn(session)
        assert max_tokens >= 1
        assert messages[-1]["role"] == "user"
        checked_messages(messages)  # every turn is a valid chat
        turns.append(messages)
        session.answered("ok")
    assert turns[0][0] == {"role": "system", "content": first.system_prompts[session.system]}
    for earlier, later in itertools.pairwise(turns):
        assert later[: len(earlier)] == earlier  # a turn extends the previous one
        assert later[len(earlier)] == {"role": "assistant", "content": "ok"}  # by its answer first


def test_documents_open_a_share_of_sessions_and_change_nothing_when_off():
    plain, again = Workload(7), Workload(7, documents=0.0)
    for _ in range(20):  # off: the same sessions and turns as a workload made without the option
        a, b = plain.session(), again.session()
        assert (a.system, a.turns_left, plain.turn(a)) == (b.system, b.turns_left, again.turn(b))
    always = Workload(7, documents=1.0)
    for _ in range(5):
        session = always.session()
        document = session.document
        assert 2000 <= len(document.split()) <= 3300
        messages, _ = always.turn(session)
        assert messages[-1]["content"].startswith(document)  # the first turn pastes it
        assert session.document == ""
