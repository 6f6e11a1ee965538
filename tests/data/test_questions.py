"""Tests for saccade.data.questions: the generic visual question and its chat messages."""

from __future__ import annotations

import pytest
from PIL import Image

from saccade.data.images import load_image
from saccade.data.messages import messages_to_inputs
from saccade.data.questions import IMAGE_PLACEHOLDER, VQASample, prompt_text, to_messages
from saccade.data.shapes import KINDS, ShapesTask, make_sample, make_split


def question(prompt: list[dict[str, str]] | None, images: int) -> VQASample:
    pictures = [Image.new("RGB", (8, 8), (10 * i, 0, 0)) for i in range(images)]
    return VQASample("q-1", pictures, "Which?", "A", ["A", "B"], "multi_choice", prompt=prompt)


def parts(message: dict) -> list:
    """A message's parts as the images' red values and the texts."""
    return [p["image"].getpixel((0, 0))[0] if p["type"] == "image" else p["text"] for p in message["content"]]


def test_prompt_text_adds_the_options_when_there_are_some():
    assert prompt_text(question(None, 1)) == "Which? Answer with one word from: A, B."
    free = VQASample("q-2", [], "How many?", "3", None, "integer")
    assert prompt_text(free) == "How many?"


def test_to_messages_format():
    s = make_sample(ShapesTask(), 3, seed=0)
    messages = to_messages(s)
    assert messages == [
        {"role": "user", "content": [{"type": "image", "image": s.images[0]}, {"type": "text", "text": prompt_text(s)}]}
    ]
    with_system = to_messages(s, system_prompt="Be brief.")
    assert with_system[0] == {"role": "system", "content": "Be brief."}
    assert with_system[1] == messages[0]
    url_part = to_messages(s, image_format="data_url")[0]["content"][0]
    assert url_part["type"] == "image_url" and url_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert load_image(url_part["image_url"]["url"]).tobytes() == s.images[0].tobytes()  # lossless
    with pytest.raises(ValueError, match="image_format"):
        to_messages(s, image_format="jpeg")


def test_a_data_sets_chat_gets_each_image_at_its_placeholder():
    chat = [{"role": "system", "content": "Look closely."},
            {"role": "user", "content": f"First {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER}: which?"}]
    system, user = to_messages(question(chat, 2))
    assert system == {"role": "system", "content": "Look closely."}  # text only: a plain string
    assert parts(user) == ["First ", 0, " then ", 10, ": which?"]


def test_a_chat_without_placeholders_gets_its_images_first_in_the_first_user_turn():
    chat = [{"role": "user", "content": "Which?"}, {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Sure?"}]
    first, answer, again = to_messages(question(chat, 2))
    assert parts(first) == [0, 10, "Which?"] and parts(again) == ["Sure?"]
    assert parts(answer) == ["A"]


def test_placeholders_and_images_that_differ_in_number_are_refused():
    chat = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER} which?"}]
    with pytest.raises(ValueError, match="2 <image> placeholders but the sample has 1 images"):
        to_messages(question(chat, 1))
    with pytest.raises(ValueError, match="no user turn"):
        to_messages(question([{"role": "system", "content": "Look."}], 1))


def test_to_messages_goes_through_messages_to_inputs(processor, limits):
    for s in make_split(ShapesTask(kinds=KINDS, num_choices=4), 3, seed=0) + [
        make_sample(ShapesTask(blank_images=True), 0, seed=0)
    ]:
        for system in (None, "Answer briefly."):
            inputs = messages_to_inputs(
                to_messages(s, system_prompt=system), processor, limits=limits, add_generation_prompt=True, sample=s.sample_id
            )
            assert inputs.num_images == 1
            assert inputs.image_grid_thw is not None and inputs.image_grid_thw.shape == (1, 3)
            assert prompt_text(s) in inputs.text
            assert isinstance(inputs.images[0], Image.Image)
    # Training conversation: prompt + the answer as the assistant turn.
    s = make_sample(ShapesTask(), 1, seed=0)
    convo = to_messages(s) + [{"role": "assistant", "content": s.answer}]
    inputs = messages_to_inputs(convo, processor, limits=limits)
    assert s.answer in processor.tokenizer.decode(inputs.input_ids[-6:])
