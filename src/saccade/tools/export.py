"""`saccade export`: a checkpoint as a folder that transformers, peft and vLLM load as they are.

- merged: the base model's folder again (config, tokenizer, processor, chat template,
  generation config, the vision tower's tensors byte for byte) with the language model
  replaced by the trained one, LoRA merged in as W + scale * B @ A. The trainer never holds
  the vision tower, so the base folder supplies it. This is `merge_full_weights_for_engine`,
  the streamed writer that hands weights to vLLM servers during training: one tensor in
  memory at a time, from either checkpoint layout (plain, or DCP from torchrun).
- adapter: a LoRA checkpoint's PEFT folder (adapter_config.json + adapter_model.safetensors),
  keys under the full model's names, so it loads onto the family's full model class
  (the family's `full_model_class`) with peft and into vLLM with `--enable-lora --lora-modules NAME=OUT`. A full fine-tuning
  checkpoint has no adapter: it exports merged only.

Both are written atomically like the checkpoints (a `.tmp-<name>-<pid>` folder beside OUT,
renamed once complete); an OUT that is not empty is refused unless `force`, and an OUT that
holds or lies inside the checkpoint or the base model is refused always. `push_to_hub` uploads
a written folder; its failure leaves the folder as it is and says how to upload it later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from saccade.atomic import remove_dead_tmp_dirs
from saccade.trainer.checkpoint.folder import (
    ADAPTER_CONFIG,
    CHECKPOINTS_DIR,
    COMPLETE,
    STATE_FILE,
    checkpoint_record,
    latest_checkpoint,
)
from saccade.trainer.checkpoint.engine_weights import copy_checkpoint_adapter, merge_full_weights_for_engine

# vLLM's --max-lora-rank takes only these values (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Exported:
    """What `export_merged` / `export_adapter` wrote."""

    out: Path
    kind: str  # "merged" or "adapter"
    checkpoint: Path  # the step folder read
    trained: str  # "lora" or "full"
    base_model: str | None  # the base folder (merged) or the base recorded in adapter_config.json
    bytes: int
    files: int


def find_checkpoint(path: Path | str) -> Path:
    """A checkpoint folder as it is; a run folder (or its checkpoints/ folder): its latest
    complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"no folder at {path}: give a checkpoint folder (<run_dir>/{CHECKPOINTS_DIR}/step_000012) "
                         "or a run folder (its latest checkpoint is exported)")
    if (path / COMPLETE).exists() or (path / STATE_FILE).exists():
        return path  # checkpoint_record says what is wrong with it, if anything
    run_dir = path.parent if path.name == CHECKPOINTS_DIR else path
    if (run_dir / CHECKPOINTS_DIR).is_dir():
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise ValueError(f"{run_dir / CHECKPOINTS_DIR} holds no complete checkpoint (none saved yet, or only "
                             "saves that did not finish)")
        return latest
    raise ValueError(f"{path} is neither a checkpoint folder (no {COMPLETE} file) nor a run folder "
                     f"(no {CHECKPOINTS_DIR}/ inside)")


def resolve_base(checkpoint: Path, recorded: str | None, override: str | None) -> Path:
    """The base model folder: `override` (--base-model) if given, else the one the checkpoint
    records. Its config must be of a family saccade knows (`saccade.models.families`)."""
    from saccade.models.loading import load_config, resolve_model_path

    if override is None and recorded is None:
        raise ValueError(f"{checkpoint} does not record its base model (state.json: checkpoint.base_model_path): "
                         "pass --base-model PATH, the model folder or hub id the run trained from")
    try:
        base = resolve_model_path(override if override is not None else recorded)
        load_config(base)
    except Exception as e:  # a missing folder, an unreachable hub, an unknown family: all say the same
        if override is not None:
            raise ValueError(f"--base-model {override}: {e}") from e
        raise ValueError(f"the base model {checkpoint} records, {recorded!r}, cannot be read ({e}). Moved or on "
                         "another machine? Pass --base-model PATH: the same model the run trained from") from e
    return base


def check_out_dir(out: Path, *, force: bool, keep: dict[str, Path]) -> None:
    """Refuse an OUT that would destroy what it is made from (`keep`: {what: folder}), a file,
    or a folder with something in it unless `force`."""
    target = out.resolve()
    for what, folder in keep.items():
        folder = folder.resolve()
        if target == folder or target in folder.parents or folder in target.parents:
            raise ValueError(f"{out} overlaps the {what} {folder}: export to a folder outside it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty: export to a new folder, or pass --force to replace it (the old "
                         "folder is swapped out only once the new one is complete)")


def export_merged(checkpoint: Path | str, out: Path | str, *, base_model: str | None = None,
                  force: bool = False) -> Exported:
    """A complete model folder: the base model's, with the trained language model (LoRA merged)."""
    step = find_checkpoint(checkpoint)
    record = checkpoint_record(step)
    base = resolve_base(step, record["base_model_path"], base_model)
    out = Path(out)
    check_out_dir(out, force=force, keep={"checkpoint": step, "base model": base})
    remove_dead_tmp_dirs(out.parent, out.name)  # an export of this OUT killed mid-write
    merge_full_weights_for_engine(step, base, out)
    return Exported(out, "merged", step, record["kind"], str(base), *folder_size(out))


def export_adapter(checkpoint: Path | str, out: Path | str, *, base_model: str | None = None,
                   force: bool = False) -> Exported:
    """A LoRA checkpoint's PEFT adapter folder. `base_model` (a hub id or folder, not read) replaces
    the base recorded in adapter_config.json: the name peft's AutoPeftModel and the hub show."""
    step = find_checkpoint(checkpoint)
    record = checkpoint_record(step)
    if record["kind"] != "lora":
        raise ValueError(f"{step} is a full fine-tuning checkpoint: there is no LoRA adapter to export. Export the "
                         "whole model with --merged OUT instead")
    out = Path(out)
    check_out_dir(out, force=force, keep={"checkpoint": step})
    remove_dead_tmp_dirs(out.parent, out.name)
    copy_checkpoint_adapter(step, out, base_model_name_or_path=base_model)
    base = json.loads((out / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return Exported(out, "adapter", step, "lora", base, *folder_size(out))


def folder_size(folder: Path) -> tuple[int, int]:
    """(bytes, files) under `folder`."""
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of rank `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank, {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def full_model_name(model: Path | str) -> str:
    """The transformers class that loads `model` whole: its family's, when its config.json is
    here to say; else the Auto class, which loads any of them (a hub id not downloaded)."""
    from saccade.models.families import family_of

    try:
        return family_of(model).full_model_class.__name__
    except ValueError:
        return "AutoModelForImageTextToText"


def usage_lines(result: Exported) -> list[str]:
    """What was written and how to load and serve it, for the command line."""
    trained = "LoRA, merged into the base model" if result.kind == "merged" and result.trained == "lora" else (
        "full fine-tuning" if result.kind == "merged" else "LoRA adapter")
    lines = [f"exported {result.checkpoint} ({trained})",
             f"  folder: {result.out} ({result.bytes / 2**20:.1f} MiB, {result.files} files)"]
    if result.kind == "merged":
        lines += [f"  base model (vision tower, tokenizer, processor, config): {result.base_model}",
                  f"  transformers: {full_model_name(result.out)}.from_pretrained('{result.out}')",
                  f"  vLLM: vllm serve {result.out}   (or: saccade serve {result.out}; on a CPU add "
                  "--dtype float32 --enforce-eager)"]
        return lines
    rank = json.loads((result.out / ADAPTER_CONFIG).read_text()).get("r", 16)
    base = result.base_model or "BASE"
    lines += [f"  base model (recorded in {ADAPTER_CONFIG}): {base}",
              f"  peft: PeftModel.from_pretrained({full_model_name(base)}.from_pretrained('{base}'), "
              f"'{result.out}')",
              f"  vLLM: vllm serve {base} --enable-lora --max-lora-rank {vllm_lora_rank(rank)} "
              f"--lora-modules {result.out.name}={result.out}   (requests name the model '{result.out.name}')"]
    return lines


class HubUploadError(RuntimeError):
    """The upload failed; the exported folder is written and complete."""


def push_to_hub(folder: Path | str, repo_id: str, *, private: bool = False) -> str:
    """Upload `folder` to the hub model repo `repo_id` (created if needed); returns the commit URL.
    The token is huggingface_hub's own (`hf auth login` or HF_TOKEN)."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    try:
        api = HfApi()
        api.create_repo(repo_id, repo_type="model", exist_ok=True, private=private or None)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                   commit_message="saccade export")
    except Exception as e:  # offline, unreachable, no token, no rights: the folder is fine either way
        raise HubUploadError(
            f"could not upload to the hub repo {repo_id} ({type(e).__name__}: {e}). The folder {folder} is written "
            f"and complete; upload it later, from a machine that reaches the hub, with: hf upload {repo_id} {folder} "
            "(log in first with `hf auth login`, or set HF_TOKEN)") from e
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")
