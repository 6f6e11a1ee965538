"""Facts behind docs/families-qwen3_vl_moe.md; run from the repo root with PYTHONPATH=src."""
import sys, torch
torch.set_num_threads(2)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tests" / "models"))
from test_qwen3_vl_moe import load_language_model, load_tower
from saccade.models.families import qwen3_vl_moe as moe
from saccade.config import ImagesConfig
from saccade.models.vision import EmbeddingCache, VisionEncoder
from saccade.parity import prepare, lm_logprobs, full_model_logprobs, max_abs
from transformers import AutoModelForImageTextToText, AutoProcessor
p = moe.tiny_model_path()
full = AutoModelForImageTextToText.from_pretrained(p, dtype=torch.float32, attn_implementation="sdpa").eval()
proc = AutoProcessor.from_pretrained(p)
limits = ImagesConfig(min_pixels=32*32, max_pixels=256*256)
enc = VisionEncoder(load_tower(p), proc, limits=limits, cache=EmbeddingCache())
pol = load_language_model(p)
cases = prepare(proc, enc, limits, enc.merge)
ref = [full_model_logprobs(full, c.inputs) for c in cases]
kw = dict(image_token_id=pol.image_token_id, merge=enc.merge)
for c, r in zip(cases, ref):
    s = lm_logprobs(pol, [c], enc, packed=False, **kw)
    print(f"{c.name:16s} images {c.sample.num_images} tokens {len(r)} single {max_abs(s, [r]):.2e}")
print(f"packed (all 5) {max_abs(lm_logprobs(pol, cases, enc, packed=True, **kw), ref):.2e}")
img = [i for i, c in enumerate(cases) if c.sample.num_images]
for m in ("drop_deepstack", "positions_1d"):
    b = lm_logprobs(pol, [cases[i] for i in img], enc, packed=False, **{m: True}, **kw)
    print(m, f"{max_abs(b, [ref[i] for i in img]):.2e}")
print("params", moe.text_params(full.config.text_config), "vision", sum(x.numel() for x in full.model.visual.parameters()))
