from __future__ import annotations

import pytest

from kvrouter.errors import ConfigError
from kvrouter.sim.policies import ChwblPolicy

from .cluster import WORKERS, book_many, make_cluster, request

PREFIX = [11, 12, 13, 14]


def _owner(policy: ChwblPolicy) -> tuple[int, int]:
    return policy.choose(request(PREFIX), make_cluster())


def test_prompts_sharing_their_first_four_blocks_share_a_worker():
    policy = ChwblPolicy()
    cluster = make_cluster()
    owner = policy.choose(request(PREFIX), cluster)
    assert policy.choose(request([*PREFIX, 99, 98]), cluster) == owner
    assert policy.key([*PREFIX, 1]) == policy.key([*PREFIX, 2]) != policy.key([11, 12, 13, 15])
    owners = {policy.choose(request([p, 0, 0, 0]), cluster) for p in range(60)}
    assert owners == set(WORKERS)  # the ring spreads different prefixes over every worker


def test_sticks_to_the_owner_up_to_the_bound_then_walks_on():
    policy = ChwblPolicy(epsilon=0.25)
    owner = _owner(policy)
    others = [w for w in WORKERS if w != owner]

    at_bound = make_cluster()  # 11 in flight: bound = 1.25 * 12 / 3 = 5
    book_many(at_bound, owner, 5)
    book_many(at_bound, others[0], 3)
    book_many(at_bound, others[1], 3)
    assert policy.choose(request(PREFIX), at_bound) == owner

    over = make_cluster()
    book_many(over, owner, 6)
    book_many(over, others[0], 3)
    book_many(over, others[1], 2)
    spill = policy.choose(request(PREFIX), over)
    assert spill != owner
    assert policy.choose(request([*PREFIX, 7]), over) == spill  # the same next worker for the prefix

    both_over = make_cluster()  # 12 in flight: bound = 1.25 * 13 / 3 = 5.42
    book_many(both_over, owner, 6)
    book_many(both_over, spill, 6)
    third = policy.choose(request(PREFIX), both_over)
    assert third not in {owner, spill}


def test_the_ring_is_the_same_in_every_instance():
    assert ChwblPolicy().key(PREFIX) == ChwblPolicy().key(PREFIX)
    assert [_owner(ChwblPolicy()) for _ in range(3)] == [_owner(ChwblPolicy())] * 3


@pytest.mark.parametrize("options", [{"prefix_blocks": 0}, {"virtual_nodes": 0}, {"epsilon": -0.1}])
def test_rejects_bad_parameters(options):
    with pytest.raises(ConfigError):
        ChwblPolicy(**options)
