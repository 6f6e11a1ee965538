"""Tests for saccade.models.positions: M-RoPE without the full model, equal to transformers'."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from saccade.data.messages import messages_to_inputs
from saccade.models.positions import mrope_positions, with_text_row
from saccade.data.synthetic import synthetic_image
from saccade.tools.parity import parity_conversations

MERGE = 2


def img(w: int, h: int, seed: int) -> dict:
    return {"type": "image", "image": synthetic_image(w, h, seed)}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


CONVERSATIONS = {
    "text_only": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "How many sides does a triangle have?"},
        {"role": "assistant", "content": "Three."},
    ],
    "one_image": [
        {"role": "user", "content": [img(64, 64, 1), text("What color is the circle?")]},
        {"role": "assistant", "content": "Red."},
    ],
    "one_wide_image_last": [
        # Non-square: the text after the image resumes at max(h, w), not at h or w.
        {"role": "user", "content": [text("Look:"), img(160, 48, 2)]},
    ],
    "several_sizes": [
        {"role": "user", "content": [img(96, 48, 3), text("Compare them."), img(40, 120, 4), img(130, 70, 5)]},
        {"role": "assistant", "content": "The first is wide and the second is tall."},
    ],
    "back_to_back": [
        {"role": "user", "content": [img(64, 64, 6), img(96, 64, 7), img(48, 80, 8), text("Which differs?")]},
    ],
    "multi_turn": [
        {"role": "user", "content": [img(64, 64, 9), text("What is in the image?")]},
        {"role": "assistant", "content": "A blue square."},
        {"role": "user", "content": [text("Now look at these."), img(80, 64, 10), img(48, 48, 11)]},
        {"role": "assistant", "content": "Two green circles."},
        {"role": "user", "content": "And the first one again?"},
    ],
}


def reference(full_model, inputs) -> torch.Tensor:
    """transformers' own get_rope_index for one sample, as (3, L)."""
    with torch.no_grad():
        pos, _ = full_model.model.get_rope_index(
            inputs.input_ids[None],
            inputs.mm_token_type_ids[None],
            image_grid_thw=inputs.image_grid_thw,
        )
    assert pos.shape == (3, 1, inputs.input_ids.shape[0])
    return pos[:, 0]


@pytest.fixture(scope="module")
def cases(processor, limits):
    out = {
        name: messages_to_inputs(messages, processor, limits=limits, sample=name)
        for name, messages in CONVERSATIONS.items()
    }
    for name, messages in parity_conversations().items():
        out[f"parity_{name}"] = messages_to_inputs(messages, processor, limits=limits, sample=name)
    return out


@pytest.mark.parametrize(
    "name", [*CONVERSATIONS, *(f"parity_{n}" for n in parity_conversations())]
)
def test_equals_transformers_get_rope_index(full_model, cases, name):
    inputs = cases[name]
    ours = mrope_positions(inputs.mm_token_type_ids, inputs.image_grid_thw, spatial_merge_size=MERGE)
    ref = reference(full_model, inputs)
    assert ours.dtype == torch.int64
    assert ours.shape == ref.shape == (3, inputs.input_ids.shape[0])
    assert torch.equal(ours, ref.long()), (ours - ref).abs().max()


def test_cases_cover_what_they_claim(cases, processor):
    """Guard the fixtures themselves: the back-to-back and multi-size cases really are that."""
    assert cases["text_only"].image_grid_thw is None
    grids = cases["several_sizes"].image_grid_thw
    assert len({tuple(g.tolist()) for g in grids}) == 3
    assert any(g[1] != g[2] for g in grids)
    ids = cases["back_to_back"].input_ids.tolist()
    vs, ve = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    # <|vision_end|><|vision_start|> adjacent: nothing but the markers between images.
    assert sum(1 for a, b in zip(ids, ids[1:]) if a == ve and b == vs) == 2
    assert len(cases["multi_turn"].image_grid_thw) == 3


def test_hand_computed_positions():
    # text(3) image(grid 1x4x6 -> 2x3 merged = 6 tokens) text(2)
    types = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    grid = torch.tensor([[1, 4, 6]])
    pos = mrope_positions(types, grid, spatial_merge_size=2)
    expected = torch.tensor(
        [
            [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],  # t: image has one frame
            [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],  # h: 2 rows
            [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],  # w: 3 cols; text resumes at 3 + max(2, 3)
        ]
    )
    assert torch.equal(pos, expected)


def test_text_only_accepts_none_or_empty_grid():
    types = torch.zeros(7, dtype=torch.long)
    expected = torch.arange(7).expand(3, -1)
    assert torch.equal(mrope_positions(types, None, spatial_merge_size=2), expected)
    assert torch.equal(mrope_positions(types, torch.zeros(0, 3, dtype=torch.long), spatial_merge_size=2), expected)
    assert mrope_positions(torch.zeros(0, dtype=torch.long), None, spatial_merge_size=2).shape == (3, 0)


def test_with_text_row(cases):
    inputs = cases["multi_turn"]
    mrope = mrope_positions(inputs.mm_token_type_ids, inputs.image_grid_thw, spatial_merge_size=MERGE)
    four = with_text_row(mrope)
    L = inputs.input_ids.shape[0]
    assert four.shape == (4, L)
    assert four.dtype == mrope.dtype
    assert torch.equal(four[0], torch.arange(L))
    assert torch.equal(four[1:], mrope)
    # With images the M-RoPE rows lag the text row: they are not a copy of it.
    assert not torch.equal(four[0], four[1])


def test_too_few_grids_raise(cases):
    inputs = cases["several_sizes"]
    with pytest.raises(ValueError, match="more image tokens than image grids"):
        mrope_positions(inputs.mm_token_type_ids, inputs.image_grid_thw[:-1], spatial_merge_size=MERGE)
    with pytest.raises(ValueError):
        mrope_positions(inputs.mm_token_type_ids, None, spatial_merge_size=MERGE)


def test_too_many_grids_raise(cases):
    inputs = cases["one_image"]
    extra = torch.cat([inputs.image_grid_thw, torch.tensor([[1, 4, 4]])])
    with pytest.raises(ValueError, match="grids given"):
        mrope_positions(inputs.mm_token_type_ids, extra, spatial_merge_size=MERGE)
    text_only = cases["text_only"]
    with pytest.raises(ValueError):
        mrope_positions(text_only.mm_token_type_ids, torch.tensor([[1, 4, 4]]), spatial_merge_size=MERGE)


def test_grid_larger_than_its_placeholders_raises(cases):
    inputs = cases["one_image"]
    bigger = inputs.image_grid_thw.clone()
    bigger[0, 1] += 2  # two more patch rows -> more tokens than the span holds
    with pytest.raises(ValueError, match="placeholder tokens"):
        mrope_positions(inputs.mm_token_type_ids, bigger, spatial_merge_size=MERGE)


def test_video_tokens_are_refused():
    types = torch.tensor([0, 2, 2, 2, 2, 0])
    with pytest.raises(ValueError, match="video"):
        mrope_positions(types, None, spatial_merge_size=2)


SRC = Path(__file__).resolve().parents[2] / "src" / "saccade"


def position_routes_outside_the_models(root: Path = SRC) -> list[str]:
    """Every place outside saccade/models that reaches an M-RoPE rule around the model's `Positions`:
    an import of saccade.models.positions, or a family's raw rule (`.mrope_positions`)."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                offenders += [f"{where}: import {a.name}" for a in node.names if a.name == "saccade.models.positions"]
            elif isinstance(node, ast.ImportFrom) and (
                    node.module == "saccade.models.positions"
                    or (node.module == "saccade.models" and any(a.name == "positions" for a in node.names))):
                offenders.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute) and node.attr == "mrope_positions":
                offenders.append(f"{where}: .mrope_positions")
    return offenders


def test_positions_go_only_through_the_models_positions_object():
    """The engines (prompts), the trainer (samples) and the multi-turn check ask one object, the model's
    `Positions` (`ModelFamily.positions`: its family's rule at its merge size), never the shared function
    or a family's rule beside it: a family whose rule differs (videos, issue 60) changes in one place."""
    assert position_routes_outside_the_models() == []


def test_the_route_check_sees_a_direct_call(tmp_path):
    """The check above is not vacuous: each way around the object is caught."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "inside.py").write_text("from saccade.models.positions import mrope_positions\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "a.py").write_text("from saccade.models.positions import mrope_positions, with_text_row\n")
    (tmp_path / "trainer" / "b.py").write_text("import saccade.models.positions\nfrom saccade.models import positions\n")
    (tmp_path / "trainer" / "c.py").write_text("def f(family, t):\n    return family.mrope_positions(t, None, 2)\n")
    (tmp_path / "trainer" / "d.py").write_text("def f(positions, t):\n    return positions.mrope(t, None)\n")
    found = position_routes_outside_the_models(tmp_path)
    assert [f.split(":")[0] for f in found] == ["trainer/a.py", "trainer/b.py", "trainer/b.py", "trainer/c.py"], found
