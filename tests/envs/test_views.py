"""The view-selection environment: rendering, actions, rewards, and that the question needs looking."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from saccade.data.shapes import COLORS
from saccade.envs.views import (
    ACTIONS,
    PLACES,
    Pose,
    RaycastRenderer,
    ViewsEnv,
    ViewsTask,
    make_view_sample,
    move,
    parse_action,
    scripted_replies,
)


def has_color(image: Image.Image, color: str) -> bool:
    pixels = np.asarray(image).reshape(-1, 3)
    return bool((pixels == np.array(COLORS[color])).all(axis=1).any())


@pytest.mark.parametrize("index", range(20))
def test_the_answer_is_hidden_at_the_start_and_shown_by_the_right_action(index):
    sample = make_view_sample(index, seed=3)
    renderer = RaycastRenderer(64)
    start = renderer.render(sample.scene, Pose())
    assert not has_color(start, sample.answer)  # not answerable without acting
    right_action = PLACES[sample.scene.place]
    assert has_color(renderer.render(sample.scene, move(Pose(), right_action)), sample.answer)
    assert sample.answer in sample.choices and len(set(sample.choices)) == len(sample.choices)


def test_rendering_is_deterministic_and_views_differ():
    sample = make_view_sample(0, seed=0)
    r = RaycastRenderer(64)
    views = [np.asarray(r.render(sample.scene, move(Pose(), a))) for a in ACTIONS]
    assert np.array_equal(views[0], np.asarray(r.render(sample.scene, move(Pose(), ACTIONS[0]))))
    assert all(not np.array_equal(views[i], views[j]) for i in range(5) for j in range(i + 1, 5))
    assert views[0].shape == (64, 64, 3)


def test_places_rotate_through_the_stream():
    task = ViewsTask(places=("left", "far"))
    assert [task.sample(i, seed=0).scene.place for i in range(4)] == ["left", "far", "left", "far"]


def test_a_palette_limits_every_color_and_option():
    task = ViewsTask(places=("left", "right"), num_choices=3, distractors=1, colors=("red", "green", "blue"))
    answers = set()
    for i in range(30):
        sample = task.sample(i, seed=1)
        assert {o.color for o in sample.scene.objects} <= {"red", "green", "blue"}
        assert sorted(sample.choices) == ["blue", "green", "red"]
        answers.add(sample.answer)
    assert answers == {"red", "green", "blue"}  # every color is sometimes the answer


@pytest.mark.parametrize(("colors", "num_choices", "distractors", "says"), [
    (("red", "green"), 3, 0, "need at least 3 colors"),
    (("red", "green", "blue"), 3, 3, "distractors"),
    (("red", "green", "teal"), 3, 0, "teal"),
])
def test_a_palette_that_cannot_make_scenes_is_refused(colors, num_choices, distractors, says):
    with pytest.raises(ValueError, match=says):
        ViewsTask(colors=colors, num_choices=num_choices, distractors=distractors)


def test_parse_action():
    assert parse_action("Turn left.") == "turn left"
    assert parse_action("I will look up now") == "look up"
    assert parse_action("red") is None
    assert parse_action("turn left then turn right") is None  # ambiguous: treated as an answer
    assert parse_action("turn leftturn leftturnturn") is None  # a reply cut by max_tokens while repeating


def test_episode_rewards_turn_cost_and_max_turns():
    sample = make_view_sample(1, seed=0)
    env = ViewsEnv(max_turns=3, turn_cost=0.05)
    opening = env.reset(sample)
    assert opening[0]["content"][0]["type"] == "image" and sample.question in opening[0]["content"][1]["text"]
    step = env.step({"role": "assistant", "content": PLACES[sample.scene.place]})
    assert not step.done and step.messages[0]["content"][0]["type"] == "image" and step.reward == 0.0
    final = env.step({"role": "assistant", "content": sample.answer})
    assert final.done and final.reward == pytest.approx(1.0 - 0.05) and final.info["correct"] == 1.0
    env.reset(sample)
    unseen = env.step({"role": "assistant", "content": sample.answer})
    assert unseen.done and unseen.reward == 0.0  # right color, never looked: a guess
    guesser = ViewsEnv(max_turns=3, require_seen=False)
    guesser.reset(sample)
    assert guesser.step({"role": "assistant", "content": sample.answer}).reward == 1.0
    env.reset(sample)
    env.step({"role": "assistant", "content": PLACES[sample.scene.place]})
    wrong = next(c for c in sample.choices if c != sample.answer)
    assert env.step({"role": "assistant", "content": wrong}).reward == pytest.approx(-0.05)  # wrong, one turn spent
    env.reset(sample)
    env.step({"role": "assistant", "content": "look up"})
    env.step({"role": "assistant", "content": "look down"})
    last = env.step({"role": "assistant", "content": "turn left"})
    assert last.done and last.info["answered"] is False  # acting on the last turn is not answering


def test_look_reward_is_paid_once_for_the_action_that_shows_the_object():
    sample = make_view_sample(0, seed=0, places=("left",))
    env = ViewsEnv(max_turns=4, look_reward=0.25)
    env.reset(sample)
    away = env.step({"role": "assistant", "content": "turn right"})
    assert away.reward == 0.0 and away.info["seen"] is False
    back = env.step({"role": "assistant", "content": "turn left"})  # back at the start: still not seen
    assert back.reward == 0.0 and back.info["seen"] is False
    look = env.step({"role": "assistant", "content": "turn left"})
    assert look.reward == 0.25 and look.info["seen"] is True
    answer = env.step({"role": "assistant", "content": sample.answer})
    assert answer.reward == 1.0 and answer.info["seen"] is True
    env.reset(sample)
    env.step({"role": "assistant", "content": "turn left"})
    env.step({"role": "assistant", "content": "turn right"})
    again = env.step({"role": "assistant", "content": "turn left"})
    assert again.reward == 0.0  # seen before: no second payment for looking again


def test_scripted_replies_look_then_answer():
    sample = make_view_sample(2, seed=0)
    rng = np.random.default_rng(0)
    lengths = set()
    for _ in range(40):
        replies = scripted_replies(sample, rng, max_turns=3)
        lengths.add(len(replies))
        assert all(r in ACTIONS for r in replies[:-1]) and replies[-1] in sample.choices
    assert lengths == {2, 3}  # at least one look, never past max_turns
    assert len(scripted_replies(sample, rng, max_turns=2)) == 2
    assert len(scripted_replies(sample, rng, max_turns=1)) == 1  # no room to look: answer


class CheckerRenderer:
    """Another renderer behind the same interface: the environment does not care which."""

    def render(self, scene, pose):
        return Image.new("RGB", (32, 32), (pose.yaw * 60, 100 + pose.pitch * 50, int(pose.z) * 20))


def test_a_renderer_plugs_in_through_the_interface():
    env = ViewsEnv(CheckerRenderer())
    env.reset(make_view_sample(0, seed=0))
    image = env.step({"role": "assistant", "content": "turn left"}).messages[0]["content"][0]["image"]
    assert image.getpixel((0, 0)) == (60, 100, 0)
