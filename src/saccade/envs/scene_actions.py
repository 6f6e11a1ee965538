"""Camera-pose actions read from an agent's reply, and the pose each one leads to.

The grammar (case ignored; one action per reply):

- ``move D forward|back|left|right|up|down``: D metres, forward and sideways along the floor
  (the heading's yaw; pitch does not tilt a step), up and down along z;
- ``turn A left|right``: A degrees of yaw (left is counter-clockwise seen from above);
- ``look A up|down``: A degrees of pitch, clamped to the camera's +-80;
- ``goto X Y Z YAW PITCH``: an absolute pose (metres, degrees);
- a JSON pose ``{"x": .., "y": .., "z": .., "yaw": .., "pitch": ..}``: absolute; keys left
  out keep their current value.

`read_action(text)` returns the `Action`, or a `str` saying why none was read: the
environment sends that reason back to the agent as its next turn (no new image, the pose
unchanged). A reply that names two actions is refused, not taken as its first: a reply cut
by max_tokens while repeating itself ("turn 90 leftturn 90 left...") must not count as
acting (the views demo's lesson, docs/envs.md).

Pure functions over poses with fields x, y, z, yaw_deg, pitch_deg (`saccade.scenes.camera.CameraPose`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

MOVE_DIRECTIONS = ("forward", "back", "left", "right", "up", "down")
MAX_MOVE_M = 5.0  # one step at most: larger jumps are what goto is for
MAX_TURN_DEG = 180.0
MAX_LOOK_DEG = 160.0  # from -80 to +80 at most
PITCH_LIMIT_DEG = 80.0  # the camera's own clamp (CameraPose)
POSE_KEYS = ("x", "y", "z", "yaw", "pitch")

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_MOVE = re.compile(rf"move\s+(?:(?P<d1>{_NUM})\s*(?:m\b|metres?\b|meters?\b)?\s*(?P<dir1>forwards?|backwards?|back|left|right|up|down)"
                   rf"|(?P<dir2>forwards?|backwards?|back|left|right|up|down)\s+(?P<d2>{_NUM}))", re.IGNORECASE)
_TURN = re.compile(rf"turn\s+(?:(?P<a1>{_NUM})\s*(?:deg(?:rees?)?\b|°)?\s*(?P<s1>left|right)"
                   rf"|(?P<s2>left|right)\s+(?P<a2>{_NUM}))", re.IGNORECASE)
_LOOK = re.compile(rf"look\s+(?:(?P<a1>{_NUM})\s*(?:deg(?:rees?)?\b|°)?\s*(?P<s1>up|down)"
                   rf"|(?P<s2>up|down)\s+(?P<a2>{_NUM}))", re.IGNORECASE)
_GOTO = re.compile(rf"goto\s+({_NUM})[\s,]+({_NUM})[\s,]+({_NUM})[\s,]+({_NUM})[\s,]+({_NUM})", re.IGNORECASE)
_JSON = re.compile(r"\{[^{}]*\}")
# A verb with something after it that the patterns above did not read: "turn left" with no
# angle, "move 2 sideways". Said back to the agent, rather than taken as an answer.
_VERB = re.compile(r"\b(move|turn|look|goto)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    verb: str  # "move", "turn", "look" (relative) or "goto" (absolute: goto and JSON poses)
    amount: float = 0.0  # metres (move) or degrees (turn, look)
    direction: str = ""  # move: forward/back/left/right/up/down; turn: left/right; look: up/down
    pose: tuple[tuple[str, float], ...] = ()  # goto: the (key, value) pairs given, keys from POSE_KEYS

    def describe(self) -> str:
        """The action in the grammar's own words, for the environment's reply."""
        if self.verb == "goto":
            return "goto " + " ".join(f"{k}={v:g}" for k, v in self.pose)
        return f"{self.verb} {self.amount:g} {self.direction}"


def _direction(word: str) -> str:
    word = word.lower()
    return {"forwards": "forward", "backward": "back", "backwards": "back"}.get(word, word)


def _relative(verb: str, match: re.Match, amount_keys=("a1", "a2"), side_keys=("s1", "s2")) -> Action:
    amount = match.group(amount_keys[0]) or match.group(amount_keys[1])
    side = match.group(side_keys[0]) or match.group(side_keys[1])
    return Action(verb, float(amount), _direction(side))


def _json_pose(text: str) -> Action | str | None:
    """The JSON pose in `text`; a reason when it is there but unusable; None when absent."""
    found = _JSON.findall(text)
    if not found:
        return None
    if len(found) > 1:
        return "two JSON poses in one reply; send one"
    try:
        value = json.loads(found[0])
    except json.JSONDecodeError as err:
        return f"the JSON pose does not parse ({err.msg}); write it as {{\"x\": 1.0, \"y\": 2.0, \"z\": 1.5, \"yaw\": 90, \"pitch\": 0}}"
    if not isinstance(value, dict) or not value:
        return "the JSON pose must be an object with some of the keys x, y, z, yaw, pitch"
    unknown = [k for k in value if k not in POSE_KEYS]
    if unknown:
        return f"the JSON pose has unknown keys {unknown}; use x, y, z, yaw, pitch"
    bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        return f"the JSON pose's {bad} must be finite numbers"
    return Action("goto", pose=tuple((k, float(value[k])) for k in POSE_KEYS if k in value))


def read_action(text: str) -> Action | str | None:
    """The one action in `text`; a str saying why it is refused; None when the reply names no
    action at all (it may be an answer)."""
    found: list[Action | str] = []
    for m in _MOVE.finditer(text):
        found.append(Action("move", float(m.group("d1") or m.group("d2")), _direction(m.group("dir1") or m.group("dir2"))))
    found += [_relative("turn", m) for m in _TURN.finditer(text)]
    found += [_relative("look", m) for m in _LOOK.finditer(text)]
    for m in _GOTO.finditer(text):
        found.append(Action("goto", pose=tuple(zip(POSE_KEYS, (float(g) for g in m.groups()), strict=True))))
    json_pose = _json_pose(text)
    if json_pose is not None:
        found.append(json_pose)
    if len(found) > 1:
        return "one action per turn, please: this reply names several"
    if not found:
        verb = _VERB.search(text)
        if verb is None:
            return None
        return (f"could not read the '{verb.group(1).lower()}' action; write 'move 0.5 forward' (back, left, right, "
                "up, down), 'turn 30 left' (right), 'look 15 up' (down), 'goto X Y Z YAW PITCH' or a JSON pose")
    action = found[0]
    return action if isinstance(action, str) else check_amount(action)


def check_amount(action: Action) -> Action | str:
    """The action, or why its size is refused."""
    limit = {"move": MAX_MOVE_M, "turn": MAX_TURN_DEG, "look": MAX_LOOK_DEG}.get(action.verb)
    if limit is None:
        return action
    unit = "m" if action.verb == "move" else " degrees"
    if not 0 < action.amount <= limit:
        return f"{action.verb} by more than 0 and at most {limit:g}{unit}, not {action.amount:g}"
    return action


def wrap_degrees(angle: float) -> float:
    """An angle in degrees folded into [-180, 180)."""
    return (angle + 180.0) % 360.0 - 180.0


def apply_action(pose: Any, action: Action) -> Any:
    """The pose after `action` (a new pose of the same type; not checked against the scene)."""
    if action.verb == "goto":
        given = dict(action.pose)
        return replace(pose, x=given.get("x", pose.x), y=given.get("y", pose.y), z=given.get("z", pose.z),
                       yaw_deg=wrap_degrees(given.get("yaw", pose.yaw_deg)),
                       pitch_deg=clamp_pitch(given.get("pitch", pose.pitch_deg)))
    if action.verb == "turn":
        sign = 1.0 if action.direction == "left" else -1.0  # yaw grows to the left (counter-clockwise)
        return replace(pose, yaw_deg=wrap_degrees(pose.yaw_deg + sign * action.amount))
    if action.verb == "look":
        sign = 1.0 if action.direction == "up" else -1.0
        return replace(pose, pitch_deg=clamp_pitch(pose.pitch_deg + sign * action.amount))
    assert action.verb == "move", action
    yaw = math.radians(pose.yaw_deg)
    forward = (math.cos(yaw), math.sin(yaw))
    left = (-math.sin(yaw), math.cos(yaw))
    dx, dy, dz = {
        "forward": (forward[0], forward[1], 0.0), "back": (-forward[0], -forward[1], 0.0),
        "left": (left[0], left[1], 0.0), "right": (-left[0], -left[1], 0.0),
        "up": (0.0, 0.0, 1.0), "down": (0.0, 0.0, -1.0),
    }[action.direction]
    d = action.amount
    return replace(pose, x=pose.x + d * dx, y=pose.y + d * dy, z=pose.z + d * dz)


def clamp_pitch(pitch: float) -> float:
    return max(-PITCH_LIMIT_DEG, min(PITCH_LIMIT_DEG, pitch))
