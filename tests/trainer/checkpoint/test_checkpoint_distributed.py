"""Sharded checkpoints (FSDP2 + torch.distributed.checkpoint) across world sizes, and engine weights
streamed from a sharded model. The ranks are real processes: torchrun over gloo on the CPU.

Three torchrun launches (about 15-25 s each here), the plain runs in this process:
1. world 2: train LoRA and full fine-tuning 2 steps, save, export engine weights, steps 3 and 4
   (saving step 3, then a step-4 save that rank 1 makes fail);
2. plain (no process group): the same training written in the plain layout, and the world-2
   checkpoints resumed into plain models;
3. world 2: the world-2 checkpoints resumed (bit-identical), and the plain ones;
4. world 1 (torchrun, still sharded): the world-2 checkpoints resumed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from saccade.distributed import SINGLE

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dist_checkpoint_worker.py")
KINDS = ("lora", "full")
REL = 1e-5  # losses at another world size: the same math, gradients summed in another order
LOGITS_TOLERANCE = 1e-5


def _worker():
    spec = importlib.util.spec_from_file_location("dist_checkpoint_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(nproc: int, jobs: list[dict], folder: Path) -> None:
    jobs_file = folder / f"jobs-{nproc}-{len(list(folder.glob('jobs-*')))}.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}  # a rank that aborts prints its Python stacks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(jobs_file)]
    # Its own session, so that a timeout ends torchrun and the workers it started, not only torchrun.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"torchrun --nproc-per-node {nproc} failed ({proc.returncode}):\n{stdout[-4000:]}\n"
                             f"{stderr[-8000:]}")


def _in_process(jobs: list[dict]) -> None:
    """Plain jobs here (no torchrun), leaving this process's RNG and thread count as they were."""
    worker = _worker()
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for job in jobs:
            worker.run_job(job, SINGLE)
    finally:
        torch.set_rng_state(saved[0]), random.setstate(saved[1]), np.random.set_state(saved[2])
        torch.set_num_threads(saved[3])


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("dist")
    base = str(tiny_path)

    def r(name: str) -> str:
        return str(d / f"{name}.pt")

    w2 = {k: str(d / f"w2-{k}" / "checkpoints" / "step_000002") for k in KINDS}
    plain = {k: str(d / f"plain-{k}" / "checkpoints" / "step_000002") for k in KINDS}

    _torchrun(2, [{"do": "train", "kind": k, "base": base, "run_dir": str(d / f"w2-{k}"), "result": r(f"train-w2-{k}"),
                   "engine": str(d / f"engine-w2-{k}")} for k in KINDS], d)
    _in_process([{"do": "train", "kind": k, "base": base, "run_dir": str(d / f"plain-{k}"),
                  "result": r(f"train-plain-{k}")} for k in KINDS]
                + [{"do": "resume", "kind": k, "base": base, "checkpoint": w2[k], "result": r(f"w2-into-plain-{k}"),
                    "engine": str(d / f"engine-plain-{k}")} for k in KINDS])
    _torchrun(2, [{"do": "resume", "kind": k, "base": base, "checkpoint": w2[k], "result": r(f"w2-into-w2-{k}")}
                  for k in KINDS]
              + [{"do": "resume", "kind": k, "base": base, "checkpoint": plain[k], "result": r(f"plain-into-w2-{k}")}
                 for k in KINDS]
              + [{"do": "resume", "kind": k, "base": base, "result": r(f"w2-step0-into-w2-{k}"),
                  "checkpoint": str(d / f"w2-{k}-step0" / "checkpoints" / "step_000000")} for k in KINDS], d)
    _torchrun(1, [{"do": "resume", "kind": k, "base": base, "checkpoint": w2[k], "result": r(f"w2-into-w1-{k}")}
                  for k in KINDS], d)
    results = {p.stem: torch.load(p, weights_only=False) for p in d.glob("*.pt")}
    return {"dir": d, "base": tiny_path, "w2": w2, "plain": plain, **results}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_snapshot(a: dict, b: dict) -> None:
    assert _same(a["weights"], b["weights"])
    assert a["moments"].keys() == b["moments"].keys()
    for name, (m, v, step) in a["moments"].items():
        m2, v2, step2 = b["moments"][name]
        assert torch.equal(m, m2) and torch.equal(v, v2) and step == step2 == 2.0, name


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= REL * abs(y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("kind", KINDS)
def test_world2_checkpoint_resumes_bit_identically_at_world2(kind, runs):
    train, resumed = runs[f"train-w2-{kind}"], runs[f"w2-into-w2-{kind}"]
    assert train["world_size"] == resumed["world_size"] == 2 and resumed["sharded"]
    _same_snapshot(resumed["saved"], train["saved"])  # weights and AdamW moments, every shard
    assert resumed["losses"] == train["losses"]  # steps 3 and 4: exactly (RNG, optimizer, scheduler restored)
    assert _same(resumed["final"], train["final"])
    assert torch.equal(resumed["logits"], train["logits"])
    state = resumed["state"]
    assert (state.step, state.data_position, state.policy_version, state.extra) == (2, 8, 2, {"note": "dist"})
    assert resumed["lr"] == pytest.approx([1e-2 / 3])


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_before_the_first_step_resumes_exactly(kind, runs):
    """A state-less optimizer goes to optimizer.pt (get_optimizer_state_dict would step it once)."""
    path = Path(runs["dir"]) / f"w2-{kind}-step0" / "checkpoints" / "step_000000"
    assert (path / "optimizer.pt").is_file() and (path / "dcp" / ".metadata").is_file()
    train, resumed = runs[f"train-w2-{kind}"], runs[f"w2-step0-into-w2-{kind}"]
    assert resumed["saved"]["moments"] == {}
    assert resumed["losses"] == train["losses_before"]


@pytest.mark.parametrize("where", ["w1", "plain"])
@pytest.mark.parametrize("kind", KINDS)
def test_world2_checkpoint_resumes_at_world1_and_without_torchrun(kind, where, runs):
    train, resumed = runs[f"train-w2-{kind}"], runs[f"w2-into-{where}-{kind}"]
    assert resumed["world_size"] == 1 and resumed["sharded"] == (where == "w1")
    _same_snapshot(resumed["saved"], train["saved"])  # resharded, not recomputed: exact
    assert _close(resumed["losses"], train["losses"]), (resumed["losses"], train["losses"])
    assert (resumed["logits"] - train["logits"]).abs().max() <= LOGITS_TOLERANCE
    assert resumed["lr"] == pytest.approx([1e-2 / 3])


@pytest.mark.parametrize("kind", KINDS)
def test_plain_checkpoint_resumes_at_world2(kind, runs):
    plain_train, resumed = runs[f"train-plain-{kind}"], runs[f"plain-into-w2-{kind}"]
    assert plain_train["world_size"] == 1 and not plain_train["sharded"] and resumed["world_size"] == 2
    path = Path(runs["plain"][kind])
    assert not (path / "dcp").exists() and (path / "optimizer.pt").is_file()  # the plain layout
    _same_snapshot(resumed["saved"], plain_train["saved"])
    assert _close(resumed["losses"], plain_train["losses"]), (resumed["losses"], plain_train["losses"])


# ------------------------------------------------------------------------------ layout, crash safety


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_layout_and_a_failed_save(kind, runs):
    root = Path(runs["w2"][kind]).parent
    step2 = root / "step_000002"
    names = {p.name for p in step2.iterdir()}
    assert {"dcp", "scheduler.pt", "state.json", "rng.pt", "rng_rank0.pt", "rng_rank1.pt", "COMPLETE"} <= names
    assert ("adapter" in names) == (kind == "lora") and "model.safetensors" not in names and "optimizer.pt" not in names
    manifest = json.loads((step2 / "COMPLETE").read_text())["files"]
    assert "dcp/.metadata" in manifest and {f"dcp/__{r}_0.distcp" for r in range(2)} <= set(manifest)
    info = json.loads((step2 / "state.json").read_text())["checkpoint"]
    assert (info["layout"], info["world_size"], info["kind"], info["format"]) == ("dcp", 2, kind, 2)
    prefix = "base_model.model." if kind == "lora" else ""  # the tiny model ties lm_head to the embeddings
    assert info["tied"] == {f"{prefix}lm_head.weight": f"{prefix}model.language_model.embed_tokens.weight"}
    # rank 1 could not write its RNG file at step 4: both ranks raised, nothing was published,
    # no temp folder is left, and steps 2 and 3 (keep_last 2) are still there.
    raised = runs[f"train-w2-{kind}"]["failed_save"]
    assert raised[1] == "OSError: disk full"
    assert raised[0] == ("RuntimeError: checkpoint save failed on another rank "
                         "(rank 1: OSError: disk full; nothing was published)")
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]


def test_world2_checkpoint_into_a_plain_bf16_model_restores_its_float32_masters(runs):
    """Full fine-tuning in bf16 without FSDP keeps float32 master weights in the optimizer: the
    sharded checkpoint's float32 weights and moments go there, the model gets them rounded."""
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.trainer.checkpoint.saving import load_checkpoint
    from saccade.trainer.step import build_optimizer

    model = set_full_finetune(load_policy_lm(runs["base"], dtype=torch.bfloat16))
    optimizer, scheduler = build_optimizer(model, lr=1e-2, weight_decay=0.01, schedule=lambda s: 1.0)
    masters = optimizer.master_weights.named
    load_checkpoint(Path(runs["w2"]["full"]), model=model, optimizer=optimizer, scheduler=scheduler)
    saved = runs["train-w2-full"]["saved"]
    assert masters.keys() == saved["weights"].keys()
    for name, param in model.named_parameters():
        assert torch.equal(masters[name], saved["weights"][name]), name
        assert torch.equal(param, saved["weights"][name].to(torch.bfloat16)), name
        m, v, _ = saved["moments"][name]
        state = optimizer.state[masters[name]]
        assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v) and float(state["step"]) == 2


def test_errors_are_clear_for_sharded_checkpoints(runs, tmp_path):
    from saccade.config import LoraConfig
    from saccade.models.lm import apply_lora, load_policy_lm
    from saccade.trainer.checkpoint.saving import load_checkpoint

    worker = _worker()
    lora_path, full_path = Path(runs["w2"]["lora"]), Path(runs["w2"]["full"])
    full, full_opt, _ = worker.setup("full", runs["base"], SINGLE)
    lora, _, _ = worker.setup("lora", runs["base"], SINGLE)
    with pytest.raises(ValueError, match="LoRA checkpoint but the model is not a peft model"):
        load_checkpoint(lora_path, model=full)
    with pytest.raises(ValueError, match="full fine-tuning checkpoint but the model is a peft"):
        load_checkpoint(full_path, model=lora)
    other = apply_lora(load_policy_lm(runs["base"]), LoraConfig(rank=4, alpha=16))
    with pytest.raises(ValueError, match="lora_alpha"):
        load_checkpoint(lora_path, model=other)
    broken = tmp_path / "broken"
    shutil.copytree(full_path, broken)
    os.remove(broken / "scheduler.pt")
    with pytest.raises(ValueError, match="missing files"):
        load_checkpoint(broken, model=full, optimizer=full_opt)


# ------------------------------------------------------------------------------ HF / engine outputs


def test_world2_lora_adapter_loads_in_peft_with_the_trained_logits(runs):
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    worker = _worker()
    adapter = Path(runs["w2"]["lora"]) / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(runs["base"])
    assert config["auto_mapping"]["base_model_class"] == "Qwen3VLForConditionalGeneration"
    with torch.no_grad():
        full = Qwen3VLForConditionalGeneration.from_pretrained(runs["base"], dtype=torch.float32).eval()
        base_logits = full(input_ids=worker.text_ids()).logits
        logits = PeftModel.from_pretrained(full, str(adapter)).eval()(input_ids=worker.text_ids()).logits
    trained = runs["train-w2-lora"]["logits"]
    assert (logits - trained).abs().max() <= LOGITS_TOLERANCE
    assert (base_logits - trained).abs().max() > 1e-3  # the adapter is not a no-op
    # save_adapter_for_engine from the sharded model: the same tensors as the checkpoint's adapter
    engine_adapter = runs["dir"] / "engine-w2-lora-adapter"
    weights = "adapter_model.safetensors"
    assert (engine_adapter / weights).read_bytes() == (adapter / weights).read_bytes()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("kind", KINDS)
def test_engine_weights_from_the_sharded_model_equal_the_unsharded_ones(kind, runs, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    worker = _worker()
    sharded, plain = runs["dir"] / f"engine-w2-{kind}", runs["dir"] / f"engine-plain-{kind}"
    a, b = _tensors(sharded), _tensors(plain)  # the same weights, gathered shard by shard vs held whole
    assert a.keys() == b.keys() and all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)
    base = _tensors(runs["base"])
    assert a.keys() == base.keys()
    assert all(torch.equal(a[k], base[k]) for k in a if k.startswith("model.visual."))
    # And merged from the sharded checkpoint folder itself (dcp/ read tensor by tensor, or adapter/).
    again = merge_full_weights_for_engine(runs["w2"][kind], runs["base"], tmp_path / "engine")
    c = _tensors(again)
    assert c.keys() == a.keys() and all(c[k].numpy().tobytes() == a[k].numpy().tobytes() for k in a)
    with torch.no_grad():
        model = Qwen3VLForConditionalGeneration.from_pretrained(sharded, dtype=torch.float32).eval()
        logits = model(input_ids=worker.text_ids()).logits
    assert (logits - runs[f"train-w2-{kind}"]["logits"]).abs().max() <= LOGITS_TOLERANCE
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (sharded / name).read_bytes() == (Path(runs["base"]) / name).read_bytes()
