"""peft on the tiny Qwen3-VL-MoE's PolicyLM: attention via target_modules, experts via target_parameters."""
import sys, json, torch, peft, tempfile
torch.set_num_threads(2)

from saccade.models.lm import load_policy_lm as load_language_model
from saccade.models.families import qwen3_vl_moe as moe
print("peft", peft.__version__)
from saccade.models.presets import preset_path
path = preset_path("moe-tiny")
policy = load_language_model(path)
cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r"model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj)",
                      target_parameters=list(moe.EXPERT_PARAMS), bias="none")
model = peft.get_peft_model(policy, cfg, autocast_adapter_dtype=True)
state = peft.get_peft_model_state_dict(model)
for k, v in state.items():
    if "layers.0." in k: print(k, tuple(v.shape))
print(len(state), "adapter tensors")
print(type(model.base_model.model.model.language_model.layers[0].mlp.experts).__name__)
# a non-zero B so the adapter does something; forward, backward
with torch.no_grad():
    for n, p in model.named_parameters():
        if "lora_B" in n: p.normal_(0, 0.05)
ids = torch.randint(0, 1000, (1, 12))
pos = torch.arange(12).view(1, 1, 12).expand(4, 1, 12)
h = model.base_model.model.hidden_states(ids, pos)
h.float().pow(2).mean().backward()
g = {n: p.grad is not None and p.grad.abs().sum().item() > 0 for n, p in model.named_parameters() if p.requires_grad and "layers.0." in n}
print("grads:", g)
with torch.no_grad():
    ref = model.base_model.model.hidden_states(ids, pos)
    merged = model.merge_and_unload()
    out = merged.hidden_states(ids, pos)
print("merge_and_unload max diff", (out - ref).abs().max().item())
print("merged expert shapes", merged.model.language_model.layers[0].mlp.experts.gate_up_proj.shape)
d = tempfile.mkdtemp()
model2 = peft.get_peft_model(load_language_model(path), cfg)
model2.save_pretrained(d)
print(json.load(open(d + "/adapter_config.json"))["target_parameters"])
from safetensors import safe_open
with safe_open(d + "/adapter_model.safetensors", "pt") as f:
    print([ (k, f.get_slice(k).get_shape()) for k in f.keys() if "layers.0.mlp" in k])
print("ADAPTER_DIR", d)
