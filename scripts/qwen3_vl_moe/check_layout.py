"""Facts behind docs/families-qwen3_vl_moe.md; run from the repo root with PYTHONPATH=src."""
import torch, json, sys
torch.set_num_threads(2)
from saccade.models.families import qwen3_vl_moe as m
from saccade.models.presets import build_config, build_tokenizer, preset_path
p = preset_path('moe-tiny')
print(p, json.load(open(p/'config.json'))['text_config'].get('num_experts'))
from transformers import AutoModelForImageTextToText, AutoConfig, AutoProcessor
# the in-memory model, rebuilt from the same seed
cfg = AutoConfig.from_pretrained(p)
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    mem = m.full_model_class()(build_config('moe-tiny', build_tokenizer(1024, seed=0))).eval()
loaded = AutoModelForImageTextToText.from_pretrained(p, dtype=torch.float32).eval()
print(type(loaded).__name__)
sd1, sd2 = mem.state_dict(), loaded.state_dict()
print('same keys', set(sd1)==set(sd2), 'max param diff', max((sd1[k]-sd2[k]).abs().max().item() for k in sd1))
proc = AutoProcessor.from_pretrained(p)
from saccade.data.synthetic import synthetic_image
msgs=[{"role":"user","content":[{"type":"image","image":synthetic_image(64,64,1)},{"type":"text","text":"What color is the circle?"}]}]
text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
inp = proc(text=[text], images=[synthetic_image(64,64,1)], return_tensors='pt')
with torch.no_grad():
    a = mem(**inp).logits; b = loaded(**inp).logits
print('logits max diff', (a-b).abs().max().item(), a.shape)
# the wrong way: plain save_pretrained (memory layout) -> what transformers does with it
import tempfile
d = tempfile.mkdtemp()
mem.save_pretrained(d)
from safetensors import safe_open
with safe_open(d+'/model.safetensors','pt') as f:
    print('save_pretrained writes', f.get_slice('model.language_model.layers.0.mlp.experts.down_proj').get_shape(), f.get_slice('model.language_model.layers.0.mlp.experts.gate_up_proj').get_shape())
