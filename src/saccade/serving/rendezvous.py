"""The weight transfer's rendezvous, bound and keyed: both ends of it (the trainer's and the servers').

The trainer opens a TCPStore where the servers' workers meet it to form a gloo group, then
streams the language model's weights to that group. torch's TCPStore takes no key, lets any
client list and set its keys, and its server listens on every interface whatever host it is
given. Two things keep the weights for the servers the run asked:

- **Bound**: the store listens on one socket, bound to the address the servers were told to reach
  (`engine.transfer_address`, or 127.0.0.1 when every server is on this machine), and handed to
  torch (`master_listen_fd`): on a loopback address nothing beyond this machine reaches it.
- **Keyed**: the run's token goes to each server in the body of its keyed
  `/init_weight_transfer_engine` request. Once the group is formed, and before any weight is
  sent, the trainer broadcasts a fresh random challenge; every worker answers
  HMAC-SHA256(token, challenge || its rank) in one all-gather, and the trainer compares each
  answer. A peer that joined the store without the token (a stranger on the network, or a process
  that took a worker's place) cannot answer: the trainer refuses the group (`RendezvousRefused`)
  and sends nothing to it. A fresh challenge per group means an answer seen once is no use again.

No vLLM here: `saccade.serving.transfer` (in the server's workers) and the trainer's sync import it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import socket

import torch

CHALLENGE_BYTES = 32
ANSWER_BYTES = hashlib.sha256().digest_size


class RendezvousRefused(PermissionError):
    """A peer in the weight-transfer group did not hold the run's token."""


def new_token() -> str:
    """A run's rendezvous token: 128 random bits, hex."""
    return secrets.token_hex(16)


def listening_store(address: str, world_size: int, timeout: datetime.timedelta):
    """A TCPStore (the group's master) listening only on `address`, on a port the OS picks. ValueError
    naming the address when this machine has no such address to bind."""
    import torch.distributed as dist

    try:
        sock = socket.create_server((address, 0), backlog=128)
    except OSError as err:
        raise ValueError(f"cannot listen for the weight transfer on {address!r} ({err}): set "
                         "engine.transfer_address to an address of this machine that the servers reach") from err
    port = sock.getsockname()[1]
    # The store's server (libuv) owns the socket from here and closes it with the store.
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def expected_answer(token: str, challenge: bytes, rank: int) -> bytes:
    """What rank `rank` answers to `challenge` when it holds `token`."""
    return hmac.new(token.encode(), challenge + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def _broadcast_challenge(group, challenge_buffer: torch.Tensor) -> None:
    """Rank 0's challenge into every rank's `challenge_buffer`."""
    import torch.distributed as dist

    group.broadcast([challenge_buffer], dist.BroadcastOptions()).wait()


def _gather_answers(group, world_size: int, answer: bytes) -> list[bytes]:
    """Every rank's answer, by rank (rank 0, the trainer, answers zeros)."""
    answers = [torch.zeros(ANSWER_BYTES, dtype=torch.uint8) for _ in range(world_size)]
    group.allgather([answers], [torch.tensor(list(answer), dtype=torch.uint8)]).wait()
    return [bytes(a.tolist()) for a in answers]


def challenge_peers(group, token: str, world_size: int) -> None:
    """The trainer's side (rank 0), right after the group forms: every other rank must answer the
    challenge with the token, else RendezvousRefused naming the ranks that did not."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    _broadcast_challenge(group, torch.tensor(list(challenge), dtype=torch.uint8))
    answers = _gather_answers(group, world_size, bytes(ANSWER_BYTES))
    wrong = [rank for rank in range(1, world_size)
             if not hmac.compare_digest(answers[rank], expected_answer(token, challenge, rank))]
    if wrong:
        raise RendezvousRefused(f"rank(s) {wrong} of the weight-transfer group did not hold this run's token: a "
                                "process that the run did not ask joined the rendezvous; no weights were sent")


def answer_challenge(group, token: str, rank: int, world_size: int) -> None:
    """A server worker's side (rank `rank`), right after the group forms."""
    challenge_buffer = torch.zeros(CHALLENGE_BYTES, dtype=torch.uint8)
    _broadcast_challenge(group, challenge_buffer)
    _gather_answers(group, world_size, expected_answer(token, bytes(challenge_buffer.tolist()), rank))
