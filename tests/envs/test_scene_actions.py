"""Camera-pose actions: every form the grammar reads, what it refuses, and the pose each leads to."""

from __future__ import annotations

import math

import pytest

from saccade.envs.scene_actions import Action, apply_action, read_action, wrap_degrees
from saccade.scenes.camera import CameraPose


@pytest.mark.parametrize(("text", "action"), [
    ("move 0.5 forward", Action("move", 0.5, "forward")),
    ("Move 1 m back.", Action("move", 1.0, "back")),
    ("move 0.25 metres left", Action("move", 0.25, "left")),
    ("move right 2", Action("move", 2.0, "right")),
    ("move 0.3 up", Action("move", 0.3, "up")),
    ("I will move .5 down now", Action("move", 0.5, "down")),
    ("move 1 backwards", Action("move", 1.0, "back")),
    ("turn 30 left", Action("turn", 30.0, "left")),
    ("Turn 90 degrees right", Action("turn", 90.0, "right")),
    ("turn left 45", Action("turn", 45.0, "left")),
    ("look 15 up", Action("look", 15.0, "up")),
    ("look 20 degrees down", Action("look", 20.0, "down")),
    ("goto 1 2 1.5 90 -10", Action("goto", pose=(("x", 1.0), ("y", 2.0), ("z", 1.5), ("yaw", 90.0), ("pitch", -10.0)))),
    ("goto 1, 2, 1.5, 90, 0", Action("goto", pose=(("x", 1.0), ("y", 2.0), ("z", 1.5), ("yaw", 90.0), ("pitch", 0.0)))),
    ('{"x": 1, "y": 2.5, "z": 1.2, "yaw": -90, "pitch": 5}',
     Action("goto", pose=(("x", 1.0), ("y", 2.5), ("z", 1.2), ("yaw", -90.0), ("pitch", 5.0)))),
    ('pose: {"yaw": 180}', Action("goto", pose=(("yaw", 180.0),))),
])
def test_every_action_form_is_read(text, action):
    assert read_action(text) == action


@pytest.mark.parametrize("text", ["red", "answer: red", "three", "the chair is blue", "", "it looks green"])
def test_a_reply_without_an_action_is_not_refused_as_one(text):
    assert read_action(text) is None  # maybe an answer: the environment decides


@pytest.mark.parametrize(("text", "says"), [
    ("turn 90 leftturn 90 leftturn 90", "one action per turn"),  # cut by max_tokens while repeating
    ("turn 30 left then move 1 forward", "one action per turn"),
    ("turn left", "could not read the 'turn' action"),
    ("move 2 sideways", "could not read the 'move' action"),
    ("goto 1 2 3", "could not read the 'goto' action"),
    ("move 9 forward", "at most 5m"),
    ("move 0 forward", "more than 0"),
    ("turn 270 left", "at most 180 degrees"),
    ('{"x": 1, "roll": 3}', "unknown keys ['roll']"),
    ('{"x": "far"}', "finite numbers"),
    ('{"x": 1,}', "does not parse"),
    ('{"x": 1} {"y": 2}', "two JSON poses"),
])
def test_bad_actions_are_refused_with_a_reason(text, says):
    reason = read_action(text)
    assert isinstance(reason, str) and says in reason


START = CameraPose(1.0, 2.0, 1.5, 0.0, 0.0)


def close(pose, x, y, z, yaw, pitch):
    return all(math.isclose(a, b, abs_tol=1e-9) for a, b in
               zip((pose.x, pose.y, pose.z, pose.yaw_deg, pose.pitch_deg), (x, y, z, yaw, pitch), strict=True))


@pytest.mark.parametrize(("text", "expected"), [
    ("move 0.5 forward", (1.5, 2.0, 1.5, 0.0, 0.0)),  # yaw 0 faces +x
    ("move 0.5 back", (0.5, 2.0, 1.5, 0.0, 0.0)),
    ("move 0.5 left", (1.0, 2.5, 1.5, 0.0, 0.0)),  # left of +x is +y (z up, counter-clockwise)
    ("move 0.5 right", (1.0, 1.5, 1.5, 0.0, 0.0)),
    ("move 0.5 up", (1.0, 2.0, 2.0, 0.0, 0.0)),
    ("move 0.5 down", (1.0, 2.0, 1.0, 0.0, 0.0)),
    ("turn 30 left", (1.0, 2.0, 1.5, 30.0, 0.0)),
    ("turn 30 right", (1.0, 2.0, 1.5, -30.0, 0.0)),
    ("look 15 up", (1.0, 2.0, 1.5, 0.0, 15.0)),
    ("look 95 down", (1.0, 2.0, 1.5, 0.0, -80.0)),  # clamped to the camera's limit
    ("goto 3 4 1 200 10", (3.0, 4.0, 1.0, -160.0, 10.0)),  # yaw folded into [-180, 180)
    ('{"z": 1.0}', (1.0, 2.0, 1.0, 0.0, 0.0)),  # keys left out keep their value
])
def test_pose_updates(text, expected):
    assert close(apply_action(START, read_action(text)), *expected)


def test_moves_follow_the_heading_not_the_pitch():
    facing_left = CameraPose(0.0, 0.0, 1.5, 90.0, -30.0)
    assert close(apply_action(facing_left, read_action("move 1 forward")), 0.0, 1.0, 1.5, 90.0, -30.0)
    assert close(apply_action(facing_left, read_action("move 1 right")), 1.0, 0.0, 1.5, 90.0, -30.0)


def test_wrap_degrees():
    assert [wrap_degrees(a) for a in (0, 180, -180, 190, -190, 720)] == [0, -180, -180, -170, 170, 0]
