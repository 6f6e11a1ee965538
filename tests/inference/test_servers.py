"""The server pool's rules, without a server: least-loaded routing, taking out, putting back,
idle time."""

from __future__ import annotations

import pytest

from saccade.inference.servers import NoServerError, ServerPool


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_go_to_the_least_loaded_live_server_round_robin_on_ties():
    pool = ServerPool(["a", "b", "c"])
    first = [pool.pick().url for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]  # ties rotate
    pool.begin(pool.servers["a"])
    pool.begin(pool.servers["b"])
    assert pool.pick().url == "c"
    pool.take_out(pool.servers["c"], "refused")
    pool.begin(pool.servers["a"])
    assert pool.pick().url == "b"  # a has 2 in flight, b 1, c is out


def test_a_request_avoids_the_servers_it_failed_on_while_others_live():
    pool = ServerPool(["a", "b"])
    assert pool.pick(exclude={"a"}).url == "b"
    pool.take_out(pool.servers["b"], "gone")
    assert pool.pick(exclude={"a"}).url == "a"  # nothing else live: the one it failed on


def test_no_live_server_names_each_and_why():
    pool = ServerPool(["http://a", "http://b"])
    assert pool.take_out(pool.servers["http://a"], "ConnectError")
    assert not pool.take_out(pool.servers["http://a"], "again")  # counted once
    pool.take_out(pool.servers["http://b"], "ReadTimeout")
    with pytest.raises(NoServerError, match=r"http://a: again; http://b: ReadTimeout"):
        pool.pick()
    assert pool.counters.taken_out == 2
    pool.put_back(pool.servers["http://b"], version=7)
    assert pool.pick().url == "http://b" and pool.servers["http://b"].version == 7
    assert pool.counters.rejoined == 1


def test_idle_seconds_count_only_time_with_nothing_in_flight_while_live():
    clock = Clock()
    pool = ServerPool(["a", "b"], clock=clock)
    a, b = pool.servers["a"], pool.servers["b"]
    clock.now = 1.0
    pool.begin(a)  # a idle 0..1
    clock.now = 3.0
    pool.end(a)  # busy 1..3
    pool.take_out(b, "gone")  # b idle 0..3, then out
    clock.now = 4.0
    assert pool.idle_seconds() == pytest.approx(1.0 + 1.0 + 3.0)
    pool.add("c")  # new: out until the health check puts it in
    assert [s.url for s in pool.alive] == ["a"]
    assert pool.idle_seconds() == pytest.approx(5.0)


def test_silence_counts_from_the_first_unanswered_probe_and_is_forgotten_once_nothing_is_in_flight():
    clock = Clock()
    pool = ServerPool(["a"], clock=clock)
    a = pool.servers["a"]
    pool.begin(a)
    assert pool.busy == [a]
    clock.now = 10.0
    assert pool.probed(a, answered=False, asked_at=8.0) == 2.0  # from when the unanswered probe was sent
    clock.now = 11.0
    assert pool.probed(a, answered=False, asked_at=10.5) == 3.0  # still from the first one
    assert pool.probed(a, answered=True, asked_at=10.9) == 0.0 and a.silent_since is None
    clock.now = 12.0
    assert pool.probed(a, answered=False, asked_at=11.5) == 0.5  # afresh after an answer
    pool.end(a)  # idle: not watched, and the next request starts with a clean slate
    assert a.silent_since is None and pool.busy == []
    pool.begin(a)
    pool.take_out(a, "hung")
    assert pool.busy == []  # an out server is not watched: the health check's rejoin probes it
    a.silent_since = 3.0
    pool.put_back(a, version=None)
    assert a.silent_since is None
