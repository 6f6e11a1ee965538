"""The mesh-scenes environment: questions from a generated room's labels, start poses, refusals,
and the rewards (right answer, turn cost, view quality) worked out by hand."""

from __future__ import annotations

import pytest

from saccade.config import RunConfig
from saccade.envs.scenes import (
    START_FRACTION_MAX,
    SceneSample,
    ScenesTask,
    color_questions,
    count_questions,
    on_questions,
    render,
    scene_questions,
    scripted_replies,
    target_fraction,
)
from saccade.scenes.camera import CameraPose
from saccade.scenes.generate import generate_room, write_scannet_layout

DEMO = dict(kinds=("color",), colors=("red", "green", "blue"), render_size=64, start_turn=90.0, say_side=True,
            max_turns=3, describe_actions=False, seen_fraction=0.05)


@pytest.fixture(scope="module")
def task():
    return ScenesTask(**DEMO)


@pytest.fixture(scope="module")
def sample(task):
    return task.sample(3, seed=0)


def test_questions_and_answers_come_from_the_labels():
    scene = next(s for s in (generate_room(i, seed=0) for i in range(20))
                 if sum(o.label == "cup" for o in s.objects) >= 2)
    objects = {o.id: o for o in scene.objects}
    labels = [o.label for o in scene.objects]
    colors = color_questions(scene, ("red", "green", "blue", "yellow", "purple", "orange"))
    assert colors, "a generated room has colored objects with unique labels"
    for q in colors:
        (target,) = q["targets"]
        assert q["question"] == f"What color is the {objects[target].label}?"
        assert q["answer"] == objects[target].color and labels.count(objects[target].label) == 1
    assert any(o.on is not None for o in scene.objects)  # cups and books stand on things here
    for q in count_questions(scene, max_count=5):
        support = next(o for o in scene.objects if q["question"].endswith(f"on the {o.label}?"))
        label = q["question"].split()[2][:-1]  # "How many cups are ..." -> "cup"
        assert q["answer"] == str(sum(o.label == label and o.on == support.id for o in scene.objects))
    for q in on_questions(scene):
        assert all(objects[i].label == q["answer"] for i in q["targets"])
    table = next(o for o in scene.objects if o.label == "table")
    cups = sum(o.label == "cup" and o.on == table.id for o in scene.objects)
    asked = [q for q in count_questions(scene, max_count=5) if q["question"] == "How many cups are on the table?"]
    assert [q["answer"] for q in asked] == [str(cups)]


def test_a_scene_without_support_relations_is_asked_counts_in_the_room():
    scene = generate_room(4, seed=0)
    from dataclasses import replace

    scanned = replace(scene, objects=tuple(replace(o, on=None, color=None) for o in scene.objects))
    assert color_questions(scanned, ("red", "green", "blue")) == [] and on_questions(scanned) == []
    counts = count_questions(scanned, max_count=5)
    assert counts and all(q["question"].endswith("in the room?") for q in counts)
    assert scene_questions(scanned, ("color", "count"), colors=("red", "green", "blue"), num_choices=3)


def test_a_sample_starts_away_from_its_object_and_one_turn_shows_it(task, sample):
    scene = sample.scene
    assert sample.answer in sample.choices and len(sample.choices) == 3
    assert sample.question.endswith(f"to your {sample.metadata['side']}?")
    assert scene.check_pose(sample.start) is None
    assert target_fraction(render(task.renderer, scene, sample.start), sample.target_ids) < START_FRACTION_MAX
    env = task.make_env()
    env.reset(sample)
    step = env.step({"role": "assistant", "content": f"turn 90 {sample.metadata['side']}"})
    assert not step.done and step.info["seen"] and step.info["action"] == "turn"
    assert step.messages[0]["content"][0]["type"] == "image"


def test_a_half_turn_start_with_a_close_view_and_no_other_objects_in_sight():
    """The demo's start (env.start_turn 180, view_fill 1.5, start_clear 0.01): either half turn
    shows the object, large; the start view shows no other labelled object to speak of."""
    from saccade.envs.scenes import other_fraction

    near = ScenesTask(**{**DEMO, "start_turn": 180.0, "say_side": False, "view_fill": 1.5, "start_clear": 0.01,
                         "start_poses": 1})
    far = ScenesTask(**{**DEMO, "start_turn": 180.0, "say_side": False, "start_poses": 1})
    shown = {"near": [], "far": []}
    for index in range(6):
        for name, t in (("near", near), ("far", far)):
            s = t.sample(index, seed=0)
            assert "to your" not in s.question
            start = render(t.renderer, s.scene, s.start)
            assert target_fraction(start, s.target_ids) < START_FRACTION_MAX
            if name == "near":
                assert other_fraction(start, s.scene, s.target_ids) <= 0.01
            for side in ("left", "right"):
                env = t.make_env()
                env.reset(s)
                step = env.step({"role": "assistant", "content": f"turn 180 {side}"})
                assert step.info["seen"]
            shown[name].append(env.best_fraction)
    assert sum(shown["near"]) > 1.3 * sum(shown["far"])  # closer: the object covers more of the view


def test_samples_are_deterministic_and_eval_rooms_differ(task):
    a, b = task.sample(5, seed=0), task.sample(5, seed=0)
    assert (a.question, a.answer, a.choices, a.start) == (b.question, b.answer, b.choices, b.start)
    held_out = task.eval_samples(3)
    assert [s.scene.name for s in held_out] == [s.scene.name for s in task.eval_samples(3)]
    assert all(s.scene.name.startswith(f"room-{task.eval_seed}-") for s in held_out)


def test_refusals_keep_the_pose_and_send_no_image(task, sample):
    env = task.make_env()
    env.reset(sample)
    outside = env.step({"role": "assistant", "content": "goto -5 0 1.5 0 0"})
    assert not outside.done and outside.info["refusals"] == 1 and outside.info["action"] == "refused"
    assert [p["type"] for p in outside.messages[0]["content"]] == ["text"]
    assert "outside the room" in outside.messages[0]["content"][0]["text"] and env.pose == sample.start
    garbled = env.step({"role": "assistant", "content": "hmm purple-ish"})
    assert garbled.info["refusals"] == 2 and "no action or answer" in garbled.messages[0]["content"][0]["text"]
    last = env.step({"role": "assistant", "content": "turn 90 left"})  # the last turn: acting is not answering
    assert last.done and last.info["answered"] is False and last.info["correct"] == 0.0


def test_rewards_by_hand(task, sample):
    side = sample.metadata["side"]
    wrong = next(c for c in sample.choices if c != sample.answer)
    env = ScenesTask(**{**DEMO, "turn_cost": 0.1, "view_reward": 0.5}, renderer=task.renderer).make_env()

    env.reset(sample)
    look = env.step({"role": "assistant", "content": f"turn 90 {side}"})
    best = target_fraction(render(task.renderer, sample.scene, env.pose), sample.target_ids)
    assert look.reward == 0.0 and look.info["view_fraction"] == pytest.approx(best) and best > 0.05
    right = env.step({"role": "assistant", "content": f"Answer: {sample.answer}"})
    assert right.done and right.info["correct"] == 1.0
    assert right.reward == pytest.approx(1.0 - 0.1 * 1 + 0.5 * best)

    env.reset(sample)
    env.step({"role": "assistant", "content": f"turn 90 {side}"})
    env.step({"role": "assistant", "content": f"turn 90 {'left' if side == 'right' else 'right'}"})  # away again
    assert env.step({"role": "assistant", "content": wrong}).reward == pytest.approx(0.0 - 0.1 * 2 + 0.5 * best)

    env.reset(sample)
    guess = env.step({"role": "assistant", "content": sample.answer})  # never looked: a guess scores 0
    assert guess.info["correct"] == 0.0 and guess.reward == pytest.approx(0.5 * guess.info["view_fraction"])


def test_scripted_replies_act_then_answer(sample):
    import numpy as np

    from saccade.envs.scene_actions import read_action

    rng = np.random.default_rng(0)
    for _ in range(20):
        replies = scripted_replies(sample, rng, max_turns=3)
        assert 2 <= len(replies) <= 3 and replies[-1] in sample.choices
        assert all(not isinstance(read_action(r), str) and read_action(r) is not None for r in replies[:-1])
    for _ in range(20):  # the demo's warm start: turns only, by the given angles
        replies = scripted_replies(sample, rng, max_turns=2, turns=(90.0, 180.0))
        assert len(replies) == 2 and replies[-1] in sample.choices
        action = read_action(replies[0])
        assert action.verb == "turn" and action.amount in (90.0, 180.0)


def test_a_folder_of_scenes_is_split_by_name(tmp_path):
    for i in range(3):
        write_scannet_layout(generate_room(i, seed=7), tmp_path / f"scene000{i}_00")
    task = ScenesTask(**{**DEMO, "start_turn": 0.0, "say_side": False}, scene_dir=str(tmp_path), eval_scenes=1)
    names = {task.sample(i, seed=0).metadata["scene"] for i in range(4)}
    held_out = {s.metadata["scene"] for s in task.eval_samples(2)}
    assert len(names) == 2 and len(held_out) == 1 and not names & held_out


def test_the_config_builds_the_task_and_refuses_what_cannot_work():
    from saccade.run.tasks import task_from_config

    cfg = RunConfig.model_validate({"task": {"kind": "scenes", "num_choices": 3, "render_size": 64,
                                             "start_turn": 90, "say_side": True}})
    task = task_from_config(cfg)
    assert isinstance(task, ScenesTask) and task.render_size == 64 and task.start_turn == 90
    assert task.num_choices == 3 and task.kinds == ("color",)
    with pytest.raises(ValueError, match="say_side needs start_turn"):
        RunConfig.model_validate({"task": {"kind": "scenes", "say_side": True}})
    with pytest.raises(ValueError, match="unknown to task kind 'scenes'"):
        RunConfig.model_validate({"task": {"kind": "scenes", "question_kinds": ["shape"]}})
    RunConfig.model_validate({"task": {"kind": "scenes", "num_choices": 3, "colors": ["red", "green", "white"]}})
    with pytest.raises(ValueError, match=r"colors \['white'\] unknown"):  # the views room draws no white
        RunConfig.model_validate({"task": {"kind": "views", "num_choices": 3, "colors": ["red", "green", "white"]}})


def test_the_config_lists_the_environment_kinds():
    from saccade.config import SCENE_QUESTION_KINDS
    from saccade.envs.scenes import SCENE_QUESTION_KINDS as kinds

    assert tuple(SCENE_QUESTION_KINDS) == kinds


def test_scene_sample_type():
    assert SceneSample.__dataclass_fields__.keys() >= {"scene", "question", "answer", "choices", "start"}
    assert CameraPose(0, 0, 1).yaw_deg == 0.0
