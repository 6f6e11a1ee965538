"""What `/update_weights` is checked against before vLLM sees a folder: the served model's tensors
and shapes in the layout saccade writes for vLLM (`reference_shapes`), a pushed full-weights folder
(`check_weights_folder`) and a pushed LoRA adapter folder (`check_adapter_folder`). A folder vLLM
would choke on (unknown names, wrong shapes, a corrupt header) is refused with a 400 instead."""

import json
from pathlib import Path

from saccade.serving.validation import RequestError

def reference_shapes(layout) -> dict[str, list[int]]:
    """The served model's tensors (a `CheckpointLayout`) and their shapes as saccade writes them
    for vLLM (`CheckpointLayout.engine_shapes`), plus the tensors its files hold that the model
    does not read (Qwen3.5's `mtp.*`), under their stored names: a weights folder saccade wrote
    copies those as they are."""
    from saccade.models.checkpoint_layout import safetensors_files

    stored = _header_shapes(safetensors_files(layout.path))
    unused = layout.classify(stored).unused
    return {**layout.engine_shapes(), **{k: stored[k] for k in unused}}


# safetensors' own bound on a header; a larger length field means a corrupt or hostile file.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


def _header_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Tensor name -> shape from safetensors headers; ValueError for a file that is not one."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= MAX_SAFETENSORS_HEADER_BYTES:
                raise ValueError(f"{f.name}: header length {n} is not that of a safetensors file")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"{f.name}: the header is not a JSON object")
        for k, v in header.items():
            if k == "__metadata__":
                continue
            if not (isinstance(v, dict) and isinstance(v.get("shape"), list)):
                raise ValueError(f"{f.name}: tensor {k[:80]!r} has no shape")
            shapes[k] = v["shape"]
    return shapes


def check_weights_folder(path: str, reference: dict[str, list[int]], canonical=lambda key: key) -> int:
    """Refuse a folder vLLM would choke on: missing, empty, unknown names, wrong shapes. Names are
    compared as `reference_shapes` keys them: a stored name the reference has, else its canonical
    one (`canonical`: transformers' renames, `CheckpointLayout.canonical`), so a folder under the
    hub's names or transformers' passes (vLLM reads both)."""
    folder = Path(path)
    if not folder.is_dir():
        raise RequestError(f"weights folder {path!r} does not exist on the server")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RequestError(f"weights folder {path!r} holds no *.safetensors files")
    try:
        shapes = {k if k in reference else canonical(k): v for k, v in _header_shapes(files).items()}
    except (OSError, ValueError) as err:
        raise RequestError(f"weights folder {path!r}: unreadable safetensors header ({err})") from None
    unknown = sorted(set(shapes) - set(reference))
    if unknown:
        raise RequestError(f"weights folder {path!r}: {len(unknown)} tensors the served model does not have, e.g. {unknown[:3]}")
    wrong = [(k, s, reference[k]) for k, s in shapes.items() if list(s) != list(reference[k])]
    if wrong:
        k, got, want = wrong[0]
        raise RequestError(f"weights folder {path!r}: {len(wrong)} tensors of the wrong shape, e.g. {k} is {got}, the model's is {want}")
    return len(shapes)


def check_adapter_folder(path: str) -> None:
    """Refuse an adapter folder vLLM would choke on: missing, or without PEFT's two files."""
    folder = Path(path)
    if not folder.is_dir():
        raise RequestError(f"adapter folder {path!r} does not exist on the server")
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (folder / f).is_file()]
    if missing:
        raise RequestError(f"adapter folder {path!r} lacks {missing} (a PEFT save_pretrained folder)")
