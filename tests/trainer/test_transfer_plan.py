"""The collective weight transfer's pure parts, without a server: what a sync sends (the tiny
model's language model, in the tensors, names and bytes a weights folder holds, grouped by
layer), the chunk format both ends share, the checks on the routes' bodies, and how a run
chooses its sync. Against a real server: tests/serving/test_vllm_weight_transfer.py."""

from __future__ import annotations

import json

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from saccade.serving.validation import RequestError, parse_finish, parse_transfer_chunk, parse_transfer_init
from saccade.trainer.weight_transfer import Outgoing, layer_groups, trainer_address, transfer_plan


def out(name: str) -> Outgoing:
    return Outgoing(name, name, torch.float32, (2,))


def test_layer_groups_put_the_rest_first_then_each_layer_in_order():
    names = ["lm_head.weight", "model.language_model.layers.10.mlp.up_proj.weight",
             "model.language_model.embed_tokens.weight", "model.language_model.layers.2.input_layernorm.weight",
             "model.language_model.layers.2.mlp.up_proj.weight", "model.language_model.norm.weight"]
    groups = [[i.name for i in g] for g in layer_groups([out(n) for n in names])]
    assert groups == [["lm_head.weight", "model.language_model.embed_tokens.weight", "model.language_model.norm.weight"],
                      names[3:5], [names[1]]]


def test_the_plan_is_the_language_model_a_weights_folder_holds(tiny_path, tmp_path):
    from saccade.models.lm import load_policy_lm
    from saccade.trainer.checkpoint.engine_weights import _LiveWeights, merge_full_weights_for_engine
    from saccade.trainer.weight_transfer import CollectiveSync

    model = load_policy_lm(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    groups = transfer_plan(_LiveWeights(model), tiny_path)
    items = [i for g in groups for i in g]
    assert items and not any("visual" in i.name for i in items)
    written = {}
    for f in merge_full_weights_for_engine(model, tiny_path, tmp_path / "w").glob("*.safetensors"):
        written |= load_file(f)
    lm = {k: v for k, v in written.items() if "visual" not in k}
    assert sorted(i.name for i in items) == sorted(lm)  # every LM tensor of the folder, nothing else
    sync = CollectiveSync(SimpleNamespace(), model, tiny_path, address="127.0.0.1")  # no server: only the bytes
    for group in groups:
        buffer = sync._materialize(group)
        at = 0
        for item in group:  # the chunk's bytes are the folder's tensors, back to back
            expected = lm[item.name].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(buffer[at:at + item.nbytes], expected), item.name
            at += item.nbytes
        assert at == buffer.numel()


def test_trainer_address_is_loopback_only_for_local_servers():
    assert trainer_address(["http://127.0.0.1:8000", "http://localhost:8001"], None) == "127.0.0.1"
    assert trainer_address(["http://gpu-3:8000"], "10.0.0.5") == "10.0.0.5"
    with pytest.raises(ValueError, match="transfer_address"):
        trainer_address(["http://127.0.0.1:8000", "http://gpu-3:8000"], None)


def test_across_nodes_the_servers_meet_the_trainer_at_the_layouts_first_trainer_node():
    from saccade.config import RunConfig, load_config
    from saccade.run.setup import choose_weight_sync

    nodes = [{"host": "10.0.0.7", "trainer_ranks": 1, "servers": 0}, {"host": "10.0.0.8", "servers": 2}]
    cfg = load_config(RunConfig, "configs/demo.toml", ["--engine.kind", "vllm", "--lora", "false",
                                                       "--engine.weight_sync", "auto", "--launch.nodes", json.dumps(nodes)])
    assert cfg.launch.trainer_host == "10.0.0.7" and cfg.engine.urls[0].startswith("http://10.0.0.8:")
    assert trainer_address(cfg.engine.urls, None, cfg.launch.trainer_host) == "10.0.0.7"
    info = {"weight_transfer": {"backend": "saccade_gloo", "workers": 1}}
    kind, why = choose_weight_sync(cfg.engine, lora=False, infos=[info, info], layout_host=cfg.launch.trainer_host)
    assert kind == "collective" and "meet this trainer at 10.0.0.7" in why
    assert RunConfig().launch.trainer_host is None


def test_transfer_bodies_are_checked():
    info = {"master_address": "10.0.0.1", "master_port": 29600, "world_size": 2, "session": "ab12", "token": "f" * 32}
    assert parse_transfer_init({"init_info": info}) == info
    without_token = {k: v for k, v in info.items() if k != "token"}
    for bad in ({"init_info": {**info, "master_port": 0}}, {"init_info": {**info, "world_size": 1}},
                {"init_info": without_token}, {"init_info": {**info, "token": "short"}},
                {"init_info": {**info, "rank": 3}}, {"init_info": {**info, "master_address": ""}},
                {"init_info": {**info, "session": 7}}, {}):
        with pytest.raises(RequestError):
            parse_transfer_init(bad)
    chunk = {"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}}
    assert parse_transfer_chunk(chunk) == chunk["update_info"]
    for bad in ({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2], [3]]},
                {"names": ["a"], "dtype_names": ["complex64"], "shapes": [[2]]},
                {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]},
                {"names": [], "dtype_names": [], "shapes": []}):
        with pytest.raises(RequestError):
            parse_transfer_chunk({"update_info": bad})
    assert parse_finish(None, 4) == 5 and parse_finish({"version": 9}, 4) == 9
    with pytest.raises(RequestError):
        parse_finish({"version": -1}, 4)


def test_the_run_chooses_its_sync_and_says_why():
    from saccade.run.setup import choose_weight_sync

    offers = [{"weight_transfer": {"backend": "saccade_gloo", "workers": 1}}]
    older = [{"model": "tiny"}]

    def cfg(sync, urls=("http://127.0.0.1:8000",), address=None):
        return SimpleNamespace(weight_sync=sync, urls=list(urls), transfer_address=address)

    assert choose_weight_sync(cfg("files"), lora=False, infos=offers)[0] == "files"
    assert choose_weight_sync(cfg("collective"), lora=True, infos=offers)[0] == "lora"
    kind, why = choose_weight_sync(cfg("auto"), lora=False, infos=offers)
    assert kind == "collective" and "127.0.0.1" in why
    kind, why = choose_weight_sync(cfg("auto"), lora=False, infos=older)
    assert kind == "files" and "offer no saccade_gloo" in why
    kind, why = choose_weight_sync(cfg("auto", urls=["http://gpu-3:8000"]), lora=False, infos=offers)
    assert kind == "files" and "transfer_address" in why
    with pytest.raises(ValueError, match="transfer_address"):
        choose_weight_sync(cfg("collective", urls=["http://gpu-3:8000"]), lora=False, infos=offers)
    assert choose_weight_sync(cfg("collective", urls=["http://gpu-3:8000"], address="10.0.0.5"), lora=False,
                              infos=offers)[0] == "collective"


def test_chunk_views_cut_the_bytes_back_into_tensors():
    pytest.importorskip("vllm", reason="saccade.serving.transfer is vLLM's engine class")
    from saccade.serving.transfer import chunk_nbytes, chunk_views

    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.int64).reshape(2, 3)
    c, d = torch.randn(5).to(torch.bfloat16), torch.randn(2)  # d starts off float32's alignment
    buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in (a, b, c, d)])
    dtypes, shapes = ["float32", "int64", "bfloat16", "float32"], [[3, 4], [2, 3], [5], [2]]
    assert chunk_nbytes(dtypes, shapes) == buffer.numel()
    got = chunk_views(buffer, dtypes, shapes)
    assert all(torch.equal(x, y) for x, y in zip(got, (a, b, c, d), strict=True))
    with pytest.raises(ValueError):
        chunk_views(buffer[:-2], dtypes, shapes)
