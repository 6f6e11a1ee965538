"""How a run chooses the way its weights reach the servers, and says why
(saccade.transports.choose): from `engine.weight_sync`, LoRA or not, the servers' /saccade/info
and where they are. The backends by where the processes are: test_backends.py. The transports
themselves against real servers: tests/serving/test_vllm_weight_transfer.py, test_vllm_training.py."""

from __future__ import annotations

import json

import pytest

from saccade.config import RunConfig, VLLMEngineConfig, load_config
from saccade.transports.choose import check_servers_take_weights, choose
from saccade.transports.collective import trainer_address

OFFERS = [{"weight_transfer": {"backend": "saccade_gloo", "workers": 1, "devices": [{"type": "cpu"}]}}]
OLDER = [{"model": "tiny"}]


def engine(sync: str, urls=("http://127.0.0.1:8000",), address=None) -> VLLMEngineConfig:
    fields = {"kind": sync} | ({"transfer_address": address} if address else {})
    return VLLMEngineConfig(urls=list(urls), weight_sync=fields)


def test_trainer_address_is_loopback_only_for_local_servers():
    assert trainer_address(["http://127.0.0.1:8000", "http://localhost:8001"], None) == "127.0.0.1"
    assert trainer_address(["http://gpu-3:8000"], "10.0.0.5") == "10.0.0.5"
    with pytest.raises(ValueError, match="transfer_address"):
        trainer_address(["http://127.0.0.1:8000", "http://gpu-3:8000"], None)


def test_the_run_chooses_its_sync_and_says_why():
    assert choose(engine("files"), lora=False, infos=OFFERS)[0] == "files"
    assert choose(engine("files"), lora=True, infos=OFFERS)[0] == "files"  # LoRA merged into full weights
    assert choose(engine("adapter"), lora=True, infos=OFFERS)[0] == "adapter"
    with pytest.raises(ValueError, match="needs LoRA"):
        choose(engine("adapter"), lora=False, infos=OFFERS)
    kind, backend, why = choose(engine("auto"), lora=False, infos=OFFERS)
    assert kind == "collective" and backend == "gloo" and "127.0.0.1" in why and "saccade's" in why
    kind, backend, why = choose(engine("auto"), lora=False, infos=OLDER)
    assert kind == "files" and backend is None and "offer no weight transfer" in why
    kind, _, why = choose(engine("auto", urls=["http://gpu-3:8000"]), lora=False, infos=OFFERS)
    assert kind == "files" and "transfer_address" in why
    with pytest.raises(ValueError, match="transfer_address"):
        choose(engine("collective", urls=["http://gpu-3:8000"]), lora=False, infos=OFFERS)
    assert choose(engine("collective", urls=["http://gpu-3:8000"], address="10.0.0.5"), lora=False,
                  infos=OFFERS)[0] == "collective"


def test_across_nodes_the_servers_meet_the_trainer_at_the_layouts_first_trainer_node():
    nodes = [{"host": "10.0.0.7", "trainer_ranks": 1, "servers": 0}, {"host": "10.0.0.8", "servers": 2}]
    cfg = load_config(RunConfig, "configs/demo.toml", ["--engine.kind", "vllm", "--lora", "false",
                                                       "--engine.weight_sync.kind", "auto",
                                                       "--launch.nodes", json.dumps(nodes)])
    assert cfg.launch.trainer_host == "10.0.0.7" and cfg.engine.urls[0].startswith("http://10.0.0.8:")
    assert trainer_address(cfg.engine.urls, None, cfg.launch.trainer_host) == "10.0.0.7"
    kind, backend, why = choose(cfg.engine, lora=False, infos=OFFERS * 2, layout_host=cfg.launch.trainer_host)
    assert kind == "collective" and backend == "gloo" and "meet this trainer at 10.0.0.7" in why
    assert RunConfig().launch.trainer_host is None


def test_a_server_that_cannot_take_what_the_transport_sends_is_named():
    urls = ["http://127.0.0.1:8000"]
    check_servers_take_weights("files", [{}], urls)
    with pytest.raises(ValueError, match="8000 cannot load the trainer's weights: fused experts"):
        check_servers_take_weights("collective", [{"weight_updates_refused": "fused experts"}], urls)
    with pytest.raises(ValueError, match="no LoRA support"):
        check_servers_take_weights("adapter", [{"lora_enabled": False}], urls)
    check_servers_take_weights("adapter", [{"lora_enabled": True}], urls)
