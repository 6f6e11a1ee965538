"""`saccade export` on real runs of the tiny model: a LoRA run and a full fine-tuning run, each
trained for real, exported, and loaded by transformers and peft (a real vLLM CPU server
serves the exports in tests/serving/test_vllm_export.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from export_runs import FULL, LORA, train_run

from saccade.tools.export import HubUploadError, export_adapter, export_merged, push_to_hub
from saccade.models.families import FAMILIES
from saccade.models.presets import preset_path, tiny_preset

# Max |Δ logprob| between two fp32 paths that compute the same function (parity.TOLERANCE).
FP32_BAR = 1e-5


@pytest.fixture(scope="module")
def full_run(tiny_path, tmp_path_factory):
    """(run folder, the trained policy, the base folder it recorded, since moved away)."""
    work = tmp_path_factory.mktemp("full-run")
    base = work / "base"
    shutil.copytree(tiny_path, base)
    run_dir, policy = train_run(work / "run", base, FULL)
    moved = work / "base-moved"
    base.rename(moved)
    return run_dir, policy, moved


@pytest.fixture(scope="module")
def parity_cases(tiny_path, processor, limits):
    """The parity conversations (images and text), their pixels and their cached image embeddings."""
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import VisionEncoder
    from saccade.tools.parity import prepare

    encoder = VisionEncoder(load_vision_tower(tiny_path), processor, limits=limits)
    return prepare(processor, encoder, limits), encoder


def _transformers(folder):
    from saccade.models.families import family_of

    model, info = family_of(folder).full_model_class().from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    return model.eval(), info


def _full_logprobs(model, cases):
    from saccade.tools.parity import full_model_logprobs

    return [full_model_logprobs(model, c.inputs) for c in cases]


def _policy_logprobs(policy, parity_cases):
    from saccade.models.lm import unwrap_policy
    from saccade.tools.parity import lm_logprobs

    cases, encoder = parity_cases
    return lm_logprobs(policy, cases, encoder, image_token_id=unwrap_policy(policy).image_token_id,
                       merge=encoder.merge, packed=False)


def _assert_merged_matches(out: Path, policy, base: Path, parity_cases) -> float:
    """OUT loads in transformers with every key, and computes the trained policy's logprobs."""
    from saccade.tools.parity import max_abs

    model, info = _transformers(out)
    assert {k: v for k, v in info.items() if v} == {}, info  # nothing missing, unexpected, mismatched
    cases, _ = parity_cases
    assert any(c.sample.num_images for c in cases)
    exported = _full_logprobs(model, cases)
    gap = max_abs(exported, _policy_logprobs(policy, parity_cases))
    assert gap <= FP32_BAR, gap
    # Not vacuous: training moved the logprobs far beyond the bar.
    assert max_abs(exported, _full_logprobs(_transformers(base)[0], cases)) > 1000 * FP32_BAR
    # The folder is complete: every file the base model ships beside its weights.
    for p in base.iterdir():
        if p.is_file() and not p.name.startswith("."):
            assert (out / p.name).is_file(), p.name
    return gap


@pytest.mark.slow
def test_merged_lora_export_is_the_trained_policy_in_transformers(merged, lora_run, tiny_path, parity_cases):
    from transformers import AutoProcessor

    _, policy = lora_run
    assert merged.trained == "lora" and merged.checkpoint.name == "step_000002"
    _assert_merged_matches(merged.out, policy, tiny_path, parity_cases)
    AutoProcessor.from_pretrained(str(merged.out))  # tokenizer, image processor and chat template load


@pytest.mark.slow
def test_adapter_export_loads_with_peft_and_equals_the_merged_export(adapter, merged, tiny_path, parity_cases):
    from peft import PeftModel

    from saccade.tools.parity import max_abs

    config = json.loads((adapter.out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.out.iterdir()}
    cases, _ = parity_cases
    peft_model = PeftModel.from_pretrained(_transformers(tiny_path)[0], str(adapter.out)).eval()
    # get_base_model(): the Qwen3-VL model with peft's LoRA layers in it, active
    assert max_abs(_full_logprobs(peft_model.get_base_model(), cases), _full_logprobs(_transformers(merged.out)[0], cases)) <= FP32_BAR


@pytest.mark.slow
def test_full_finetune_export_with_a_moved_base(full_run, tmp_path, parity_cases):
    run_dir, policy, moved = full_run
    with pytest.raises(ValueError, match="--base-model"):
        export_merged(run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = export_merged(run_dir, tmp_path / "out", base_model=str(moved))
    assert result.trained == "full"
    _assert_merged_matches(result.out, policy, moved, parity_cases)
    with pytest.raises(ValueError, match="--merged"):
        export_adapter(run_dir, tmp_path / "adapter")


@pytest.mark.slow
def test_out_is_never_overwritten_by_accident(lora_run, tmp_path):
    run_dir, _ = lora_run
    step = run_dir / "checkpoints" / "step_000002"
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--force"):
        export_adapter(step, out)
    assert (out / "notes.txt").read_text() == "mine"
    export_adapter(step, out, force=True, base_model="Qwen/Qwen3-VL-2B-Instruct")
    assert not (out / "notes.txt").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "Qwen/Qwen3-VL-2B-Instruct"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left beside it
    for inside in (run_dir, step, step / "adapter"):  # what it is made from: refused even with --force
        with pytest.raises(ValueError, match="overlaps the checkpoint"):
            export_adapter(step, inside, force=True)
    with pytest.raises(ValueError, match="neither a checkpoint folder"):
        export_merged(tmp_path, tmp_path / "x")


def test_push_to_hub_failure_says_the_folder_is_written(tmp_path):
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py: the real client, refusing offline
    with pytest.raises(HubUploadError) as err:
        push_to_hub(folder, "someone/saccade-export-test")
    text = str(err.value)
    assert "offline" in text and f"{folder} is written and complete" in text
    assert f"hf upload someone/saccade-export-test {folder}" in text


@pytest.mark.slow
def test_cli_export_then_push_to_an_unreachable_hub(lora_run, tmp_path, capsys):
    """The command as a user runs it; the hub is a closed local port (the real client's real failure)."""
    from saccade.serving.launch import free_port

    run_dir, _ = lora_run
    out = tmp_path / "adapter"
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-m", "saccade.cli", "export", str(run_dir), "--adapter", str(out),
                           "--push-to-hub", "someone/repo"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    assert f"folder: {out}" in done.stdout and "--lora-modules adapter=" in done.stdout
    assert "ConnectError" in done.stderr and "hf upload someone/repo" in done.stderr
    assert (out / "adapter_model.safetensors").is_file()
    from saccade.cli import main

    assert main(["export", str(run_dir), "--adapter", str(out)]) == 2  # OUT is not empty now
    assert "--force" in capsys.readouterr().err


def _tensor_headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from saccade.models.loading import safetensors_files
    from saccade.trainer.checkpoint.engine_weights import _safetensors_header

    return {k: (v["dtype"], tuple(v["shape"])) for f in safetensors_files(folder)
            for k, v in _safetensors_header(f)[2].items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_trains_and_exports_in_its_base_layout(family, kind, tmp_path, limits):
    """`saccade rl` on the family's tiny model (LoRA, with the family's targets and target_parameters, or full
    fine-tuning), then `saccade export --merged`: the files hold the base's keys, dtypes and
    shapes (a MoE's experts in the hub layout: non-square, so a transposition shows), and the
    family's transformers class loads them with every key and computes the trained policy's
    logprobs. A LoRA run's `--adapter` export, loaded by peft on the base, equals the merged one."""
    from peft import PeftModel

    from saccade.models.loading import load_processor, load_vision_tower
    from saccade.models.vision import VisionEncoder
    from saccade.tools.parity import max_abs, prepare

    base = preset_path(tiny_preset(family))
    # The config leaves the targets unset: the family's own, Qwen3.5's Gated DeltaNet projections
    # included, are trained, merged and exported.
    run_dir, policy = train_run(tmp_path / "run", base, LORA if kind == "lora" else FULL)
    result = export_merged(run_dir, tmp_path / "out")
    assert result.trained == kind
    assert _tensor_headers(result.out) == _tensor_headers(base)
    processor = load_processor(base)
    encoder = VisionEncoder(load_vision_tower(base), processor, limits=limits)
    cases = (prepare(processor, encoder, limits), encoder)
    gap = _assert_merged_matches(result.out, policy, base, cases)
    if kind == "lora":
        adapter = export_adapter(run_dir, tmp_path / "adapter")
        peft_model = PeftModel.from_pretrained(_transformers(base)[0], str(adapter.out)).eval()
        merged = _full_logprobs(_transformers(result.out)[0], cases[0])
        assert max_abs(_full_logprobs(peft_model.get_base_model(), cases[0]), merged) <= FP32_BAR
    print(f"{family.name} {kind}: exported vs trained max |Δ logprob| {gap:.2e}")
