"""Checkpoints: exact resume (weights, optimizer, scheduler, RNG), atomic saves, HF-loadable outputs
(the engine weights of `saccade.trainer.checkpoint.engine_weights` included, from a live model and from a checkpoint)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import saccade.atomic
import saccade.trainer.checkpoint.saving as ckpt
from saccade.config import LoraConfig
from saccade.models.lm import apply_lora, load_policy_lm, set_full_finetune
from saccade.trainer.checkpoint.saving import TrainState, load_checkpoint, load_latest_checkpoint, save_checkpoint
from saccade.trainer.checkpoint.folder import check_complete, latest_checkpoint, write_manifest
from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine
from saccade.models.lm import unwrap_policy

TOLERANCE = 1e-5  # fp32 logits, max |Δ|: the same math in a different order (merged W vs W + BA)
L = 12  # tokens in the text-only test input


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: a second OpenMP thread buys nothing, and on a busy 2-core machine
    its barrier waits made single forward/backward passes take seconds instead of milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _make(tiny_path, kind: str, seed: int = 0):
    """A fresh model, AdamW and LambdaLR. `seed` changes LoRA's random init (lora_A)."""
    torch.manual_seed(seed)
    policy = load_policy_lm(tiny_path)
    if kind == "lora":
        model = apply_lora(policy, LoraConfig(rank=4, alpha=8))
    else:
        model = set_full_finetune(policy)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _positions(input_ids_BL: torch.Tensor) -> torch.Tensor:
    """Text-only positions [text; t; h; w]: all four rows are 0..L-1."""
    B, n = input_ids_BL.shape
    return torch.arange(n).expand(4, B, n)


def _logits(model, input_ids_BL: torch.Tensor) -> torch.Tensor:
    policy = unwrap_policy(model)
    return policy.lm_head(policy.hidden_states(input_ids_BL, _positions(input_ids_BL)))


def _train_step(model, optimizer, scheduler) -> None:
    """One AdamW step on a batch drawn from the global torch RNG (so RNG restore matters)."""
    ids = torch.randint(0, 1000, (2, L))
    logits = _logits(model, ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _draws():
    return torch.rand(5), random.random(), np.random.rand(3)


def _assert_same_draws(a, b):
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _text_ids() -> torch.Tensor:
    return torch.randint(0, 1000, (1, L), generator=torch.Generator().manual_seed(7))


def _state(step: int) -> TrainState:
    return TrainState(step=step, data_position=8 * step, policy_version=step, extra={"loss_tail": [0.5, 0.25]})


# ------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_save_load_round_trip_resumes_exactly(kind, tiny_path, tmp_path):
    model, opt, sched = _make(tiny_path, kind)
    _train_step(model, opt, sched)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = TrainState(step=1, data_position=16, policy_version=1, extra={"config_hash": "abc", "loss": [1.5]})
    path = save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, state=state, keep_last=3,
                           base_model_path=str(tiny_path))
    assert path == tmp_path / "checkpoints" / "step_000001"
    expected_draws = _draws()
    saved_weights = _trainable(model)
    # The uninterrupted run takes one more step.
    _train_step(model, opt, sched)
    expected_next = _trainable(model)

    # A fresh process-like state: new model (different LoRA init), new optimizer, scrambled RNG.
    model2, opt2, sched2 = _make(tiny_path, kind, seed=123)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert any(not torch.equal(saved_weights[n], p) for n, p in _trainable(model2).items())
    loaded = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)

    assert loaded == state
    weights = _trainable(model2)
    assert weights.keys() == saved_weights.keys()
    assert all(torch.equal(weights[n], saved_weights[n]) for n in weights)
    # Optimizer state was saved right after step 1: compare with a fresh reading of the file.
    saved_opt = torch.load(path / "optimizer.pt", weights_only=True)
    state2 = opt2.state_dict()["state"]
    assert len(state2) == len(saved_opt["state"]) == len(weights)
    for i, s in saved_opt["state"].items():
        assert torch.equal(state2[i]["exp_avg"], s["exp_avg"]) and torch.equal(state2[i]["exp_avg_sq"], s["exp_avg_sq"])
        assert float(state2[i]["step"]) == 1.0
    assert any(s["exp_avg"].abs().sum() > 0 for s in saved_opt["state"].values())
    assert sched2.last_epoch == 1 and sched2.get_last_lr() == [pytest.approx(1e-2 / 2)]
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 2)
    _assert_same_draws(_draws(), expected_draws)
    # And the next step (batch drawn from the restored RNG) lands on the same weights.
    _train_step(model2, opt2, sched2)
    resumed_next = _trainable(model2)
    assert all(torch.equal(resumed_next[n], expected_next[n]) for n in expected_next)

    files = {p.name for p in path.iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "rng.pt", "state.json", "COMPLETE"} <= files
    assert json.loads((path / "state.json").read_text())["checkpoint"]["kind"] == kind


def test_full_weights_use_the_full_model_names_without_tied_duplicates(tiny_path, tmp_path):
    from safetensors import safe_open

    model, opt, sched = _make(tiny_path, "full")
    path = save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, state=_state(0), keep_last=1)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "adapter" not in {p.name for p in path.iterdir()}
    assert all(k.startswith("model.language_model.") for k in keys)  # tiny ties lm_head: not written
    assert "model.language_model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert keys == set(model.state_dict()) - {"lm_head.weight"}


# ------------------------------------------------------------------------------ HF-loadable


def test_lora_adapter_loads_onto_the_full_hf_model(tiny_path, tmp_path):
    from peft import AutoPeftModel, PeftModel
    from transformers import Qwen3VLForConditionalGeneration

    model, opt, sched = _make(tiny_path, "lora")
    _train_step(model, opt, sched)
    path = save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, state=_state(1), keep_last=1,
                           base_model_path=str(tiny_path))
    adapter = path / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_path)

    ids = _text_ids()
    with torch.no_grad():
        ours = _logits(model, ids)
        full = Qwen3VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()
        base_logits = full(input_ids=ids).logits
        hf = PeftModel.from_pretrained(full, str(adapter)).eval()
        hf_logits = hf(input_ids=ids).logits
        # AutoPeftModel finds the base model and its class from adapter_config.json alone.
        auto_logits = AutoPeftModel.from_pretrained(str(adapter), dtype=torch.float32).eval()(input_ids=ids).logits
    assert (hf_logits - ours).abs().max() <= TOLERANCE
    assert (auto_logits - ours).abs().max() <= TOLERANCE
    assert (base_logits - ours).abs().max() > 1e-3  # the adapter is not a no-op


@pytest.mark.parametrize("source", ["model", "checkpoint"])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_merged_engine_weights_load_and_match(kind, source, tiny_path, tmp_path):
    from safetensors import safe_open
    from transformers import Qwen3VLForConditionalGeneration

    model, opt, sched = _make(tiny_path, kind)
    _train_step(model, opt, sched)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if source == "checkpoint":
        src = save_checkpoint(tmp_path / "run", model=model, optimizer=opt, scheduler=sched, state=_state(1),
                              keep_last=1, base_model_path=str(tiny_path))
    else:
        src = model
    out = merge_full_weights_for_engine(src, str(tiny_path), tmp_path / "engine")
    # The live model is read, never changed (no merge left behind).
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    ids = _text_ids()
    with torch.no_grad():
        merged = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
        diff = (merged(input_ids=ids).logits - _logits(model, ids)).abs().max()
    assert diff <= TOLERANCE
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_path / name).read_bytes()
    with safe_open(str(tiny_path / "model.safetensors"), "pt") as b, safe_open(str(out / "model.safetensors"), "pt") as o:
        assert set(b.keys()) == set(o.keys())
        vision = [k for k in b.keys() if k.startswith("model.visual.")]
        assert vision
        for k in vision:
            assert o.get_tensor(k).numpy().tobytes() == b.get_tensor(k).numpy().tobytes(), k
        changed = [k for k in b.keys() if not torch.equal(o.get_tensor(k), b.get_tensor(k))]
    assert changed and all(k.startswith("model.language_model.") for k in changed)
    # Re-merging into the same folder replaces it in place.
    assert merge_full_weights_for_engine(src, str(tiny_path), out) == out
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------------------ layout and atomicity


@pytest.fixture(scope="module")
def lora_bundle(tiny_path):
    return _make(tiny_path, "lora")


def _save(run_dir, bundle, step, keep_last=2):
    model, opt, sched = bundle
    return save_checkpoint(run_dir, model=model, optimizer=opt, scheduler=sched, state=_state(step), keep_last=keep_last)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_keep_last_and_latest_ignores_unfinished_dirs(lora_bundle, tiny_path, tmp_path):
    assert latest_checkpoint(tmp_path) is None
    root = tmp_path / "checkpoints"
    for step in range(1, 5):
        _save(tmp_path, lora_bundle, step)
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == root / "step_000004"
    # Without base_model_path the adapter still names its base: the folder load_policy_lm read.
    adapter_config = json.loads((root / "step_000004" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_path)

    # Leftovers of crashed saves: a tmp dir (even one holding COMPLETE), a step dir without COMPLETE.
    stale = root / f".tmp-step_000009-{_dead_pid()}"
    stale.mkdir()
    (stale / "COMPLETE").write_text("{}")
    (root / "step_000010").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step_000004"
    with pytest.raises(ValueError, match="no COMPLETE"):
        load_checkpoint(root / "step_000010", model=lora_bundle[0])

    # The next save deletes the dead process's tmp dir and keeps the newest two.
    _save(tmp_path, lora_bundle, 5)
    assert not stale.exists()
    assert latest_checkpoint(tmp_path) == root / "step_000005"  # step_000010 is still incomplete
    assert sorted(p.name for p in root.iterdir() if (p / "COMPLETE").exists()) == ["step_000004", "step_000005"]


def test_crash_mid_save_leaves_the_previous_checkpoint_latest(lora_bundle, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    first = _save(tmp_path, lora_bundle, 1)
    first_bytes = (first / "state.json").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    real_save = torch.save

    def save_until_rng(obj, f, *args, **kwargs):  # rng.pt comes after weights, optimizer.pt, scheduler.pt
        if str(f).endswith("rng.pt"):
            assert (f.parent / "optimizer.pt").exists() and (f.parent / "adapter").exists()
            boom()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_until_rng)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, lora_bundle, 2)
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no half-written dir left

    # A crash while re-saving an existing step keeps the old one intact.
    monkeypatch.setattr(saccade.atomic, "fsync_tree", boom)
    with pytest.raises(OSError):
        _save(tmp_path, lora_bundle, 1)
    assert (first / "state.json").read_bytes() == first_bytes
    monkeypatch.undo()
    assert load_checkpoint(first, model=lora_bundle[0]).step == 1


@pytest.mark.parametrize("exchange", [True, False])
def test_resaving_a_step_replaces_it(exchange, lora_bundle, tmp_path, monkeypatch):
    if not exchange:  # the fallback for filesystems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(saccade.atomic, "_exchange", lambda a, b: False)
    model, opt, sched = lora_bundle
    save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, state=_state(3), keep_last=2)
    again = TrainState(step=3, data_position=99, policy_version=4, extra={"note": "second"})
    path = save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, state=again, keep_last=2)
    assert load_checkpoint(path, model=model) == again
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]


# ------------------------------------------------------------------------------ errors


def test_a_changed_newest_checkpoint_is_passed_over_for_the_one_before(lora_bundle, tmp_path):
    """A same-size change (one byte flipped in the adapter's weights: the sizes in COMPLETE alone
    would load it) is caught by COMPLETE's CRC-32s, and the resume goes on from step 1."""
    model, opt, sched = lora_bundle
    _save(tmp_path, lora_bundle, 1)
    newest = _save(tmp_path, lora_bundle, 2)
    weights = newest / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"contents changed since the save \(CRC-32\): \['adapter/adapter_model"):
        check_complete(newest, contents=True)
    with pytest.warns(UserWarning, match="step_000002 cannot be loaded .*trying the checkpoint before it"):
        path, state = load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert path.name == "step_000001" and state.step == 1
    # none that loads: every failure said
    (path / "rng.pt").write_bytes(b"x" * (path / "rng.pt").stat().st_size)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"no checkpoint under .* loads:\nstep_000002: .*"
                                                                    r"\nstep_000001: "):
        load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)



class RunsCodeWhenLoaded:
    """Unpickled, it calls open(marker, "w"): what a pickle in a checkpoint from elsewhere could
    do instead (any callable, any arguments)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _seal(path, step: int) -> None:
    """Rewrite COMPLETE for the files as they are now: a checkpoint made elsewhere vouches for itself."""
    (path / "COMPLETE").unlink()
    write_manifest(path, step)


@pytest.mark.parametrize("name", ["scheduler.pt", "optimizer.pt", "rng.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused_and_a_clean_one_resumes(name, tiny_path, tmp_path):
    """The scheduler, optimizer and RNG files are read with torch.load(weights_only=True): an object
    there that is not a tensor or a plain value is refused, naming it, and never built. Loaded with
    weights_only=False, the marker file would exist."""
    bundle = model, opt, sched = _make(tiny_path, "lora")  # its own: a load that ran code leaves no trace in others
    _train_step(model, opt, sched)
    path = _save(tmp_path, bundle, 1)
    clean = (path / name).read_bytes()
    marker = tmp_path / "code-ran"
    tampered = torch.load(path / name, weights_only=True)  # the real state, plus one entry
    tampered["note"] = RunsCodeWhenLoaded(marker)
    torch.save(tampered, path / name)
    _seal(path, 1)
    with pytest.raises(ValueError, match=rf"{name} holds an object that is not a tensor or a plain value "
                                         r"\(it names \S*open\).*could run code"):
        load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert not marker.exists()

    (path / name).write_bytes(clean)
    _seal(path, 1)
    assert load_checkpoint(path, model=model, optimizer=opt, scheduler=sched) == _state(1)
    assert not marker.exists()


def test_mismatched_kind_and_missing_files_are_value_errors(tiny_path, lora_bundle, tmp_path):
    lora_path = _save(tmp_path / "lora", lora_bundle, 1)
    full, full_opt, full_sched = _make(tiny_path, "full")
    with pytest.raises(ValueError, match="LoRA checkpoint but the model is not a peft model"):
        load_checkpoint(lora_path, model=full)
    full_path = save_checkpoint(tmp_path / "full", model=full, optimizer=full_opt, scheduler=full_sched,
                                state=_state(1), keep_last=1)
    with pytest.raises(ValueError, match="full fine-tuning checkpoint but the model is a peft"):
        load_checkpoint(full_path, model=lora_bundle[0])
    # Different LoRA settings would silently change the function: refused.
    other = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=4, alpha=16))
    with pytest.raises(ValueError, match="lora_alpha"):
        load_checkpoint(lora_path, model=other)
    with open(full_path / "rng.pt", "ab") as f:  # a file changed after the save
        f.write(b"x")
    with pytest.raises(ValueError, match="size changed"):
        load_checkpoint(full_path, model=full)
    os.remove(full_path / "optimizer.pt")
    with pytest.raises(ValueError, match="missing files"):
        load_checkpoint(full_path, model=full, optimizer=full_opt)
    with pytest.raises(ValueError, match="no checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere", model=full)
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path / "x", model=full, optimizer=None, scheduler=None, keep_last=1,
                        state=TrainState(step=1, data_position=0, policy_version=0, extra={"t": torch.zeros(1)}))
    assert not (tmp_path / "x" / "checkpoints").exists() or not any((tmp_path / "x" / "checkpoints").iterdir())
    # The LoRA-injected PolicyLM alone (not the PeftModel) must not be saved as "full" weights.
    with pytest.raises(ValueError, match="not a peft PeftModel"):
        save_checkpoint(tmp_path / "y", model=lora_bundle[0].get_base_model(), optimizer=None, scheduler=None,
                        state=_state(1), keep_last=1)
