"""View selection: look around a room to answer a question about an object not in view.

A procedurally generated room (`make_scene`): a long box with colored shapes on its walls,
ceiling and floor, two near the camera's start view and one far ahead. The agent starts
facing ahead and is asked about one object that the first view does not show (on a side
wall, the ceiling, the floor, or too far away to see its color). Each turn it either acts,
"turn left", "turn right", "look up", "look down" or "move forward", and gets the newly
rendered view, or answers. Reward: 1 for the right color, minus an optional cost per turn.

Rendering sits behind `Renderer` (`render(scene, pose) -> PIL image`): `RaycastRenderer`
ray-casts the box room with numpy and projects the shapes as sprites with a pinhole camera
(size falls with distance, far objects fade to gray). A mesh renderer (Open3D, pyrender)
can implement the same interface for real 3D scenes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from PIL import Image, ImageDraw

from saccade.data.shapes import COLORS
from saccade.envs.base import StepResult, message_text
from saccade.rewards.bounded import score

ACTIONS = ("turn left", "turn right", "look up", "look down", "move forward")
# Where the asked-about object is, and the action that brings it into view.
PLACES: dict[str, str] = {
    "left": "turn left",
    "right": "turn right",
    "ceiling": "look up",
    "floor": "look down",
    "far": "move forward",
}
PLACE_PHRASES = {
    "left": "on the wall to your left",
    "right": "on the wall to your right",
    "ceiling": "on the ceiling",
    "floor": "on the floor",
    "far": "far ahead of you",
}
SPRITES = ("circle", "square", "triangle", "diamond")

ROOM_HALF_WIDTH, ROOM_HEIGHT, ROOM_DEPTH = 3.0, 2.0, 12.0  # x in [-3, 3], y in [-2, 2], z in [-1, 12]
FORWARD_STEP = 7.0
FOG_DISTANCE = 8.0  # beyond this, colors fade to gray: the far object's color cannot be read
# Sprite radii. A side-wall object spans ~70% of its 64-px view (it was 1.2, ~40%): more of each
# 32-px image token is its color.
NEAR_RADIUS, FAR_RADIUS = 2.0, 0.9


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    position: tuple[float, float, float]  # x right, y up, z ahead
    radius: float


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    target: int  # index of the asked-about object
    place: str  # where the target is (a PLACES key)
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Pose:
    yaw: int = 0  # quarter turns to the left
    pitch: int = 0  # -1 down, 0 level, 1 up
    z: float = 0.0  # how far the camera moved forward


@dataclass
class ViewSample:
    sample_id: str
    scene: Scene
    question: str
    answer: str
    choices: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)


class Renderer(Protocol):
    def render(self, scene: Scene, pose: Pose) -> Image.Image: ...


# ----------------------------------------------------------------------------- scenes


def _place_position(place: str, rng: np.random.Generator) -> tuple[float, float, float]:
    jitter = float(rng.uniform(-0.4, 0.4))
    return {
        "left": (-ROOM_HALF_WIDTH + 0.1, jitter * 0.5, 0.0 + jitter),
        "right": (ROOM_HALF_WIDTH - 0.1, jitter * 0.5, 0.0 + jitter),
        "ceiling": (jitter, ROOM_HEIGHT - 0.1, 0.0 + jitter * 0.5),
        "floor": (jitter, -ROOM_HEIGHT + 0.1, 0.0 + jitter * 0.5),
        "far": (jitter, jitter * 0.3, ROOM_DEPTH - 1.0),
    }[place]


def check_palette(colors: tuple[str, ...], *, num_choices: int, distractors: int) -> None:
    """Raise a ValueError that says what to change when scenes cannot be drawn from `colors`."""
    unknown = [c for c in colors if c not in COLORS]
    if unknown:
        raise ValueError(f"colors {unknown} unknown; choose from {', '.join(COLORS)}")
    if len(set(colors)) != len(colors):
        raise ValueError(f"colors {list(colors)} repeat a color")
    if len(colors) < num_choices:
        raise ValueError(f"{num_choices} answer options need at least {num_choices} colors, got {list(colors)}")
    if len(colors) <= distractors:
        raise ValueError(f"{distractors} distractors of other colors than the answer need more than "
                         f"{distractors} colors, got {list(colors)}")


def make_scene(index: int, *, seed: int, places: tuple[str, ...] = tuple(PLACES), num_choices: int = 4,
               distractors: int = 2, colors: tuple[str, ...] = tuple(COLORS)) -> Scene:
    """Scene `index` of the stream for `seed`: one object in every place, and `distractors`
    objects near ahead, in the start view, none of them the target's color. Every object's
    color, and every answer option, comes from `colors`."""
    check_palette(colors, num_choices=num_choices, distractors=distractors)
    rng = np.random.default_rng([seed, index, 71])
    palette = list(colors)
    place = places[index % len(places)]
    near_colors = [str(c) for c in rng.choice(palette, size=distractors, replace=False)]
    target_color = str(rng.choice([c for c in palette if c not in near_colors]))
    objects = []
    for p in PLACES:
        color = target_color if p == place else str(rng.choice(palette))
        objects.append(SceneObject(str(rng.choice(SPRITES)), color, _place_position(p, rng),
                                   NEAR_RADIUS if p != "far" else FAR_RADIUS))
    target = list(PLACES).index(place)
    for k, color in enumerate(near_colors):  # visible from the start: what the answer is not
        x = -1.4 + 2.8 * k / max(1, distractors - 1) + float(rng.uniform(-0.2, 0.2))
        objects.append(SceneObject(str(rng.choice(SPRITES)), color, (x, float(rng.uniform(-0.4, 0.4)), 4.0), 0.6))
    others = [c for c in palette if c != target_color]
    choices = [target_color, *(str(c) for c in rng.choice(others, size=num_choices - 1, replace=False))]
    rng.shuffle(choices)
    return Scene(tuple(objects), target, place, tuple(choices))


def make_view_sample(index: int, *, seed: int, places: tuple[str, ...] = tuple(PLACES), num_choices: int = 4,
                     distractors: int = 2, colors: tuple[str, ...] = tuple(COLORS)) -> ViewSample:
    scene = make_scene(index, seed=seed, places=places, num_choices=num_choices, distractors=distractors,
                       colors=colors)
    target = scene.objects[scene.target]
    question = f"What color is the {target.shape} {PLACE_PHRASES[scene.place]}?"
    return ViewSample(f"views-{seed}-{index}", scene, question, target.color, list(scene.choices),
                      {"place": scene.place, "kind": scene.place})


# ----------------------------------------------------------------------------- rendering


def camera_axes(pose: Pose) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(right, up, forward) unit vectors of the camera in world coordinates."""
    yaw = math.pi / 2 * pose.yaw  # positive: to the left
    forward = np.array([-math.sin(yaw), 0.0, math.cos(yaw)])
    right = np.array([math.cos(yaw), 0.0, math.sin(yaw)])
    up = np.array([0.0, 1.0, 0.0])
    if pose.pitch:  # look straight up or down
        forward, up = (up * pose.pitch, -forward * pose.pitch)
    return right, up, forward


class RaycastRenderer:
    """A box room ray-cast per pixel, and the objects as flat sprites through a pinhole
    camera with a 90-degree field of view. Pure numpy and PIL, deterministic."""

    WALL = np.array([200, 190, 170], dtype=np.float32)
    CEILING = np.array([235, 235, 240], dtype=np.float32)
    FLOOR = np.array([120, 95, 70], dtype=np.float32)
    FOG = np.array([150, 150, 150], dtype=np.float32)

    def __init__(self, size: int = 64):
        self.size = size
        self.focal = size / 2  # tan(45 degrees) = 1

    def render(self, scene: Scene, pose: Pose) -> Image.Image:
        right, up, forward = camera_axes(pose)
        image = Image.fromarray(self._room(right, up, forward, pose))
        draw = ImageDraw.Draw(image)
        camera = np.array([0.0, 0.0, pose.z])
        visible = []
        for obj in scene.objects:
            rel = np.array(obj.position) - camera
            depth = float(rel @ forward)
            if depth <= 0.3:
                continue
            x = self.size / 2 + self.focal * float(rel @ right) / depth
            y = self.size / 2 - self.focal * float(rel @ up) / depth
            r = self.focal * obj.radius / depth
            if -r < x < self.size + r and -r < y < self.size + r:
                visible.append((depth, x, y, r, obj))
        for depth, x, y, r, obj in sorted(visible, key=lambda v: -v[0]):  # far to near
            fade = min(1.0, max(0.0, (depth - FOG_DISTANCE / 2) / (FOG_DISTANCE / 2)))
            color = (1 - fade) * np.array(COLORS[obj.color], dtype=np.float32) + fade * self.FOG
            _sprite(draw, obj.shape, x, y, max(r, 0.8), tuple(int(c) for c in color))
        return image

    def _room(self, right, up, forward, pose: Pose) -> np.ndarray:
        n = self.size
        coords = (np.arange(n) + 0.5 - n / 2) / self.focal
        u, v = np.meshgrid(coords, -coords)
        rays = forward[None, None] + u[..., None] * right[None, None] + v[..., None] * up[None, None]
        origin = np.array([0.0, 0.0, pose.z])
        # Distance along each ray to the box's walls, ceiling/floor and ends.
        with np.errstate(divide="ignore", invalid="ignore"):
            tx = np.where(rays[..., 0] != 0, (np.sign(rays[..., 0]) * ROOM_HALF_WIDTH - origin[0]) / rays[..., 0], np.inf)
            ty = np.where(rays[..., 1] != 0, (np.sign(rays[..., 1]) * ROOM_HEIGHT - origin[1]) / rays[..., 1], np.inf)
            end = np.where(rays[..., 2] > 0, ROOM_DEPTH, -1.0)
            tz = np.where(rays[..., 2] != 0, (end - origin[2]) / rays[..., 2], np.inf)
        hit = np.argmin(np.stack([tx, ty, tz]), axis=0)
        out = np.empty((n, n, 3), dtype=np.float32)
        out[:] = self.WALL
        out[(hit == 1) & (rays[..., 1] > 0)] = self.CEILING
        out[(hit == 1) & (rays[..., 1] < 0)] = self.FLOOR
        out[hit == 2] = self.WALL * 0.85  # the room's ends a little darker than its side walls
        return out.clip(0, 255).astype(np.uint8)


def _sprite(draw: ImageDraw.ImageDraw, shape: str, x: float, y: float, r: float, color) -> None:
    box = [x - r, y - r, x + r, y + r]
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=color)
    else:  # diamond
        draw.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=color)


# ----------------------------------------------------------------------------- the environment


def parse_action(text: str) -> str | None:
    """The one action named in a reply ("turn left", "Look up."), or None (an answer).

    Exactly one mention counts: "turn left then turn right" is ambiguous, and a reply that
    repeats itself until max_tokens cut it ("turn leftturn leftturn...") is not a valid
    action either: taken as "turn left", it counted a policy that had stopped ending its
    turns as looking correctly (and paid it, with look_reward) (docs/envs.md)."""
    cleaned = re.sub(r"[^a-z ]", " ", text.lower())
    cleaned = " ".join(cleaned.split())
    found = [a for a in ACTIONS for _ in re.finditer(re.escape(a), cleaned)]
    return found[0] if len(found) == 1 else None


def move(pose: Pose, action: str) -> Pose:
    if action == "turn left":
        return replace(pose, yaw=(pose.yaw + 1) % 4, pitch=0)
    if action == "turn right":
        return replace(pose, yaw=(pose.yaw - 1) % 4, pitch=0)
    if action == "look up":
        return replace(pose, pitch=min(1, pose.pitch + 1))
    if action == "look down":
        return replace(pose, pitch=max(-1, pose.pitch - 1))
    if pose.yaw == 0 and pose.pitch == 0:  # move forward, only along the room
        return replace(pose, z=min(pose.z + FORWARD_STEP, ROOM_DEPTH - 3.0))
    return pose


def target_pose(scene: Scene) -> Pose:
    """The pose from which the asked-about object is in view: one action from the start."""
    return move(Pose(), PLACES[scene.place])


def prompt_text(sample: ViewSample) -> str:
    # Short on purpose: every turn of every episode carries it. The actions are not listed:
    # with "turn left, turn right, ..." in every prompt the tiny model copied from the list
    # instead of reading the question (SFT on right answers learned the action in 60 steps
    # without the list and not at all with it); the warm start teaches what the actions are.
    return f"{sample.question} Options: {', '.join(sample.choices)}."


class ViewsEnv:
    """One episode in one scene: act to change the view, then answer with a color."""

    def __init__(self, renderer: Renderer | None = None, *, max_turns: int = 3, turn_cost: float = 0.0,
                 require_seen: bool = True, look_reward: float = 0.0):
        self.renderer = renderer or RaycastRenderer()
        self.max_turns = max_turns
        self.turn_cost = turn_cost
        # A per-turn reward for the action that first brings the asked-about object into view:
        # progress the agent can be credited for before it answers.
        self.look_reward = look_reward
        # An answer counts only once the object has been in view: a lucky guess is not success.
        self.require_seen = require_seen
        self.seen = False
        self.sample: ViewSample | None = None
        self.pose = Pose()
        self.turns = 0

    def view(self) -> dict[str, Any]:
        image = self.renderer.render(self.sample.scene, self.pose)
        return {"type": "image", "image": image}  # a PIL image: nothing to encode and decode again

    def reset(self, sample: ViewSample) -> list[dict[str, Any]]:
        self.sample, self.pose, self.turns, self.seen = sample, Pose(), 0, False
        return [{"role": "user", "content": [self.view(), {"type": "text", "text": prompt_text(sample)}]}]

    def step(self, assistant_message: dict[str, Any]) -> StepResult:
        self.turns += 1
        text = message_text(assistant_message)
        action = parse_action(text)
        info = {"action": action, "place": self.sample.scene.place}
        if action is None:  # an answer
            correct = score(text, self.sample.answer, choices=self.sample.choices)
            if self.require_seen and not self.seen:
                correct = 0.0
            info.update(correct=correct, answered=True, seen=self.seen)
            return StepResult([], correct - self.turn_cost * (self.turns - 1), True, info)
        if self.turns >= self.max_turns:
            info.update(correct=0.0, answered=False, seen=self.seen)
            return StepResult([], -self.turn_cost * self.turns, True, info)
        self.pose = move(self.pose, action)
        first_look = not self.seen and self.pose == target_pose(self.sample.scene)
        self.seen = self.seen or first_look
        info["seen"] = self.seen
        reply = {"role": "user", "content": [self.view(), {"type": "text", "text": f"You {action}."}]}
        return StepResult([reply], self.look_reward if first_look else 0.0, False, info)


@dataclass(frozen=True)
class ViewsTask:
    """The data stream of view-selection episodes, and the environment that runs them."""

    places: tuple[str, ...] = tuple(PLACES)
    num_choices: int = 4
    image_size: int = 64
    max_turns: int = 3
    turn_cost: float = 0.0
    eval_seed: int = 10_000  # held-out scenes come from another seed's stream
    distractors: int = 2
    require_seen: bool = True
    look_reward: float = 0.0
    colors: tuple[str, ...] = tuple(COLORS)  # the objects' palette; the demo uses three

    def __post_init__(self) -> None:
        check_palette(self.colors, num_choices=self.num_choices, distractors=self.distractors)

    def sample(self, index: int, *, seed: int) -> ViewSample:
        return make_view_sample(index, seed=seed, places=self.places, num_choices=self.num_choices,
                                distractors=self.distractors, colors=self.colors)

    def train_sample(self, position: int, *, seed: int) -> ViewSample:
        return self.sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[ViewSample]:
        return [self.sample(i, seed=self.eval_seed) for i in range(n)]

    def make_env(self) -> ViewsEnv:
        return ViewsEnv(RaycastRenderer(self.image_size), max_turns=self.max_turns, turn_cost=self.turn_cost,
                        require_seen=self.require_seen, look_reward=self.look_reward)


def scripted_replies(sample: ViewSample, rng: np.random.Generator, *, max_turns: int) -> list[str]:
    """Warm-start replies: random valid actions (1 up to max_turns - 1 of them), then a random
    choice as the answer. They teach the format (look, then answer), not the task: which
    action shows the object and which color it has are left to RL."""
    n_actions = int(rng.integers(min(1, max_turns - 1), max_turns))
    return [str(rng.choice(ACTIONS)) for _ in range(n_actions)] + [str(rng.choice(sample.choices))]
