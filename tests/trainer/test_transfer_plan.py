"""What a weight sync sends without files (saccade.trainer.transfer_plan): the tiny model's
language model, in the tensors, names and bytes a weights folder holds, grouped by layer. The
transports that send it: tests/transports/; against a real server:
tests/serving/test_vllm_weight_transfer.py."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from saccade.trainer.transfer_plan import GroupMaterializer, Outgoing, layer_groups


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
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    model = load_policy_lm(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    weights = GroupMaterializer(model, tiny_path)
    items = [i for g in weights.groups for i in g]
    assert items and not any("visual" in i.name for i in items)
    written = {}
    for f in merge_full_weights_for_engine(model, tiny_path, tmp_path / "w").glob("*.safetensors"):
        written |= load_file(f)
    lm = {k: v for k, v in written.items() if "visual" not in k}
    assert sorted(i.name for i in items) == sorted(lm)  # every LM tensor of the folder, nothing else
    assert weights.nbytes == sum(t.numel() * t.element_size() for t in lm.values())
    for group in weights.groups:
        buffer = weights.materialize(group)
        at = 0
        for item in group:  # the chunk's bytes are the folder's tensors, back to back
            expected = lm[item.name].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(buffer[at:at + item.nbytes], expected), item.name
            at += item.nbytes
        assert at == buffer.numel()
