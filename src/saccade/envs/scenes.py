"""View selection in 3D mesh scenes: move a camera through a room to answer a question
about its labelled objects.

A sample is a scene (`saccade.scenes.mesh.MeshScene`: a generated room, or a scan loaded
with `saccade.scenes.loaders.load_scene`), a question about its labels and a start pose
from which the question's objects are not (well) in view. Each turn the agent either acts
(the grammar of `saccade.envs.scene_actions`: relative moves, turns and looks, `goto`, a
JSON pose) and gets the newly rendered view, or answers. A reply that is neither, or an
action whose pose the scene refuses (outside the room, inside a wall or a piece of
furniture), gets the reason back as the next user turn, text only, with the pose
unchanged; refusals are counted in the episode's info.

Questions (`scene_questions`), all answered from the scene's labels, never from pixels:
- "color": "What color is the <label>?" (the object's `color`; a label unique in the scene);
- "count": "How many <label>s are on the <support>?" (objects whose `on` is the support), or
  "... in the room?" for scenes without support relations;
- "on": "What is on the <support>?" (one kind of object stands on it).
Real scans have no colour names unless a loader inferred them: there "count" and "on" may be
the only questions a scene offers.

Reward of the answering turn: 1 for the right option (`saccade.rewards.score`), minus
`turn_cost` per turn before it, plus `view_reward` x the largest fraction of the image the
question's objects covered in any view of the episode (`object_pixel_fraction`). The view
term is paid only with an answer: paid without one, the views demo's look reward taught a
policy to stop answering (docs/envs.md).

Renders go through one `CachedRenderer` per task, keyed by (scene, quantised pose): the G
episodes of a group start from the same pose and mostly visit the same few views. The pose
itself is kept quantised, so what is rendered is exactly the state.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from saccade.envs.base import StepResult, message_text
from saccade.envs.scene_actions import Action, apply_action, read_action
from saccade.rewards.builtin import choice_index
from saccade.rewards.bounded import extracted_answer, score

SCENE_QUESTION_KINDS = ("color", "count", "on")
# Generated rooms paint their objects with the task's colors (the neutrals are for scans).
GENERATED_COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
# A view "shows" the question's objects when they cover at least this fraction of it; a start
# pose must show them less than START_FRACTION_MAX (not at all, for a fair question).
START_FRACTION_MAX = 0.002
# The pose a demo-style start turns away from frames the target to about this share of the
# view's width: big objects relative to the image are what a tiny model can read.
VIEW_FILL = 0.9
MIN_VIEW_DISTANCE_M = 0.35
EYE_HEIGHT_M = 1.4
POSE_TRIES = 200  # candidate poses drawn per wanted start pose before giving up on a scene
_EXPLICIT_ANSWER = re.compile(r"\banswer\s*(?::|is\b)|\\boxed\s*\{", re.IGNORECASE)


@dataclass
class SceneSample:
    sample_id: str
    scene: Any  # saccade.scenes.mesh.MeshScene
    question: str
    answer: str
    choices: list[str]
    target_ids: tuple[int, ...]  # the objects whose pixels count as seeing what the question is about
    start: Any  # saccade.scenes.camera.CameraPose
    metadata: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- questions


def plural(label: str) -> str:
    return label if label.endswith("s") else label + "s"


def unique_labels(objects) -> set[str]:
    counts: dict[str, int] = {}
    for o in objects:
        counts[o.label] = counts.get(o.label, 0) + 1
    return {label for label, n in counts.items() if n == 1}


def color_questions(scene, colors: tuple[str, ...]) -> list[dict[str, Any]]:
    """One question per object whose label is unique in the scene and whose colour is in `colors`."""
    unique = unique_labels(scene.objects)
    return [{"kind": "color", "question": f"What color is the {o.label}?", "answer": o.color,
             "targets": (o.id,), "pool": tuple(colors)}
            for o in scene.objects if o.label in unique and o.color in colors]


def count_questions(scene, *, max_count: int) -> list[dict[str, Any]]:
    """How many of a label stand on a support (a label unique in the scene that holds something),
    zero included (a label seen elsewhere in the room); "in the room" when no object has `on`."""
    objects = scene.objects
    unique = unique_labels(objects)
    labels = sorted({o.label for o in objects})
    questions = []
    supports = [s for s in objects if s.label in unique and any(o.on == s.id for o in objects)]
    if not any(o.on is not None for o in objects):
        for label in labels:
            ids = tuple(o.id for o in objects if o.label == label)
            if len(ids) <= max_count:
                questions.append({"kind": "count", "question": f"How many {plural(label)} are in the room?",
                                  "answer": str(len(ids)), "targets": ids})
        return questions
    for s in supports:
        for label in labels:
            if label == s.label:
                continue
            ids = tuple(o.id for o in objects if o.label == label and o.on == s.id)
            if len(ids) <= max_count:
                questions.append({"kind": "count", "question": f"How many {plural(label)} are on the {s.label}?",
                                  "answer": str(len(ids)), "targets": ids or (s.id,)})
    return questions


def on_questions(scene) -> list[dict[str, Any]]:
    """What stands on a support (a label unique in the scene) that holds one kind of object."""
    objects = scene.objects
    unique = unique_labels(objects)
    questions = []
    for s in objects:
        above = [o for o in objects if o.on == s.id]
        kinds = {o.label for o in above}
        if s.label in unique and len(kinds) == 1:
            answer = kinds.pop()
            questions.append({"kind": "on", "question": f"What is on the {s.label}?", "answer": answer,
                              "targets": tuple(o.id for o in above),
                              "pool": tuple(sorted({o.label for o in objects} - {s.label}))})
    return questions


def scene_questions(scene, kinds: tuple[str, ...], *, colors: tuple[str, ...], num_choices: int) -> list[dict[str, Any]]:
    """Every question of `kinds` this scene's labels answer, with at least `num_choices` options."""
    out = []
    for kind in kinds:
        if kind == "color":
            out += color_questions(scene, colors)
        elif kind == "count":
            out += count_questions(scene, max_count=num_choices - 1)
        else:
            out += on_questions(scene)
    # Options other than the answer must exist: a colour from the palette, a label of the scene.
    return [q for q in out if q["kind"] == "count" or len(set(q["pool"]) - {q["answer"]}) >= num_choices - 1]


def question_choices(question: dict[str, Any], rng: np.random.Generator, num_choices: int) -> list[str]:
    """The answer and num_choices - 1 others, shuffled; counts are 0 .. num_choices - 1 in order."""
    if question["kind"] == "count":
        return [str(i) for i in range(num_choices)]
    others = sorted(set(question["pool"]) - {question["answer"]})
    choices = [question["answer"], *(str(c) for c in rng.choice(others, size=num_choices - 1, replace=False))]
    rng.shuffle(choices)
    return choices


# ----------------------------------------------------------------------------- start poses


def render(renderer, scene, pose):
    """The renderer's buffers, rendered with one torch thread: a 64-px view of a thousand
    triangles took 3 ms on one thread and 300 ms on two on this 2-core machine while another
    process ran (oversubscription, docs/platform notes); the trainer's own count is restored."""
    import torch

    threads = torch.get_num_threads()
    if threads == 1:
        return renderer.render_buffers(scene, pose)
    torch.set_num_threads(1)
    try:
        return renderer.render_buffers(scene, pose)
    finally:
        torch.set_num_threads(threads)


def target_fraction(rendered, target_ids: tuple[int, ...]) -> float:
    """The share of the image the objects cover."""
    from saccade.scenes.render import object_pixel_fraction

    return float(sum(object_pixel_fraction(rendered, i) for i in target_ids))


def facing_pose(scene, target_ids: tuple[int, ...], yaw_deg: float, *, fov_deg: float, fill: float = VIEW_FILL):
    """A pose that looks at the objects' box centre from direction `yaw_deg` (the camera stands
    on the other side), far enough that the box spans about `fill` of the view's width."""
    from saccade.scenes.camera import CameraPose, quantized

    boxes = [scene.object(i) for i in target_ids]
    lo = np.min([b.bbox_min for b in boxes], axis=0)
    hi = np.max([b.bbox_max for b in boxes], axis=0)
    center = (lo + hi) / 2
    extent = float(np.max(hi - lo))
    distance = max(MIN_VIEW_DISTANCE_M, extent / 2 / math.tan(math.radians(fov_deg) / 2) / fill + extent / 2)
    yaw = math.radians(yaw_deg)
    x, y = center[0] - distance * math.cos(yaw), center[1] - distance * math.sin(yaw)
    floor, ceiling = scene.bounds_min[2], scene.bounds_max[2]
    z = float(np.clip(center[2] + 0.5 * extent + 0.3, floor + 0.4, ceiling - 0.3))
    pitch = math.degrees(math.atan2(center[2] - z, distance))
    return quantized(CameraPose(float(x), float(y), z, yaw_deg, pitch))


def other_fraction(rendered, scene, target_ids: tuple[int, ...]) -> float:
    """The share of the image covered by labelled objects other than `target_ids`."""
    from saccade.scenes.render import object_pixel_fraction

    return float(sum(object_pixel_fraction(rendered, o.id) for o in scene.objects if o.id not in target_ids))


def start_poses(scene, target_ids: tuple[int, ...], renderer, *, n: int, rng: np.random.Generator,
                turn_deg: float = 0.0, fov_deg: float = 60.0, fill: float = VIEW_FILL,
                clear: float = 1.0) -> list[tuple[Any, str]]:
    """Up to `n` (start pose, side) pairs: valid poses (scene.check_pose) that do not show the
    objects (under START_FRACTION_MAX of the view), nor other labelled objects on more than
    `clear` of it (1: no limit).

    turn_deg = 0: anywhere in the room at eye height, any heading (side ""). turn_deg > 0: the
    start is a pose that frames the objects well, turned away by turn_deg to the left or
    right (side): "turn <turn_deg> <side>" brings them back into view, one action, what a
    small model can learn from pixels. Fewer than n when the scene has no room for more."""
    from saccade.envs.scene_actions import Action
    from saccade.scenes.camera import CameraPose, quantized

    found: list[tuple[Any, str]] = []
    lo, hi = np.array(scene.bounds_min, dtype=float), np.array(scene.bounds_max, dtype=float)
    for _ in range(POSE_TRIES * n):
        if len(found) >= n:
            break
        if turn_deg > 0:
            view = facing_pose(scene, target_ids, float(rng.uniform(-180, 180)), fov_deg=fov_deg, fill=fill)
            if scene.check_pose(view) is not None:
                continue
            if target_fraction(render(renderer, scene, view), target_ids) < 10 * START_FRACTION_MAX:
                continue  # something stands in the way, or the objects are off the view
            side = str(rng.choice(["left", "right"]))
            # Turned right by turn_deg from the view: turning left by turn_deg brings it back.
            start = quantized(apply_action(view, Action("turn", turn_deg, "right" if side == "left" else "left")))
        else:
            margin = scene.wall_margin + 0.1
            x, y = (float(rng.uniform(lo[i] + margin, hi[i] - margin)) for i in (0, 1))
            z = float(min(lo[2] + EYE_HEIGHT_M, hi[2] - margin))
            start, side = quantized(CameraPose(x, y, z, float(rng.uniform(-180, 180)), -10.0)), ""
        if scene.check_pose(start) is not None or any(start == s for s, _ in found):
            continue
        shown = render(renderer, scene, start)
        if target_fraction(shown, target_ids) >= START_FRACTION_MAX:
            continue
        if clear < 1.0 and other_fraction(shown, scene, target_ids) > clear:
            continue
        found.append((start, side))
    return found


# ----------------------------------------------------------------------------- the environment

ACTION_HELP = ("Act with one of: move D forward|back|left|right|up|down (metres), turn A left|right, look A up|down "
               "(degrees), goto X Y Z YAW PITCH; or answer.")


def prompt_text(sample: SceneSample, *, describe_actions: bool) -> str:
    # Short for the tiny model: every turn of every episode carries it, and listing the actions
    # made the views demo's model copy from the list (docs/envs.md). Real models need the grammar.
    text = f"{sample.question} Options: {', '.join(sample.choices)}."
    return f"{text} {ACTION_HELP}" if describe_actions else text


def is_answer(text: str, choices: list[str]) -> bool:
    """An explicit final answer ("answer: red", \\boxed{red}), or a reply that names an option."""
    return bool(_EXPLICIT_ANSWER.search(text)) or choice_index(extracted_answer(text), choices) is not None


def pose_text(pose) -> str:
    return f"x={pose.x:.2f} y={pose.y:.2f} z={pose.z:.2f} yaw={pose.yaw_deg:g} pitch={pose.pitch_deg:g}"


class ScenesEnv:
    """One episode in one mesh scene: act to move the camera, then answer."""

    def __init__(self, renderer, *, max_turns: int = 3, turn_cost: float = 0.0, view_reward: float = 0.0,
                 require_seen: bool = True, seen_fraction: float = 0.01, describe_actions: bool = True):
        self.renderer = renderer  # a saccade.scenes.render.CachedRenderer
        self.max_turns = max_turns
        self.turn_cost = turn_cost
        self.view_reward = view_reward
        # An answer counts only once the objects have been in view: a lucky guess is not success.
        self.require_seen = require_seen
        self.seen_fraction = seen_fraction
        self.describe_actions = describe_actions
        self.sample: SceneSample | None = None
        self.pose = None
        self.turns = self.refusals = 0
        self.best_fraction = 0.0

    def view(self) -> dict[str, Any]:
        from saccade.scenes.camera import quantized

        self.pose = quantized(self.pose)
        rendered = render(self.renderer, self.sample.scene, self.pose)
        self.best_fraction = max(self.best_fraction, target_fraction(rendered, self.sample.target_ids))
        return {"type": "image", "image": rendered.image()}

    def reset(self, sample: SceneSample) -> list[dict[str, Any]]:
        self.sample, self.pose, self.turns, self.refusals, self.best_fraction = sample, sample.start, 0, 0, 0.0
        return [{"role": "user", "content": [self.view(),
                                             {"type": "text", "text": prompt_text(sample, describe_actions=self.describe_actions)}]}]

    def info(self, **extra: Any) -> dict[str, Any]:
        stats = self.renderer.stats  # the task's CachedRenderer, shared by every episode
        return {"kind": self.sample.metadata.get("kind", ""), "refusals": self.refusals,
                "seen": self.best_fraction >= self.seen_fraction, "view_fraction": self.best_fraction,
                "render_cache_hit_rate": stats.hit_rate, "render_cache_entries": len(self.renderer), **extra}

    def step(self, assistant_message: dict[str, Any]) -> StepResult:
        from saccade.scenes.camera import quantized

        self.turns += 1
        text = message_text(assistant_message)
        # An answer first: "answer: the chair is red" names no action, and an option's text may
        # hold a verb. Then one action; anything else is refused with what the agent can send.
        answering = is_answer(text, self.sample.choices)
        action = None if answering else read_action(text)
        if not answering and action is None:
            action = (f"no action or answer read; answer with one of the options ({', '.join(self.sample.choices)}) "
                      "or act (move 0.5 forward, turn 30 left, look 15 up, goto X Y Z YAW PITCH)")
        if answering:
            seen = self.best_fraction >= self.seen_fraction
            correct = score(text, self.sample.answer, choices=self.sample.choices)
            if self.require_seen and not seen:
                correct = 0.0
            reward = correct - self.turn_cost * (self.turns - 1) + self.view_reward * self.best_fraction
            return StepResult([], reward, True, self.info(action="answer", correct=correct, answered=True))
        if self.turns >= self.max_turns:
            return StepResult([], -self.turn_cost * self.turns, True,
                              self.info(action="none", correct=0.0, answered=False))
        if isinstance(action, Action):
            # Quantised before the check: the snapped pose is the one rendered (and cached).
            new_pose = quantized(apply_action(self.pose, action))
            reason = self.sample.scene.check_pose(new_pose)
            if reason is None:
                self.pose = new_pose
                reply = f"You {action.describe()}." + (f" Pose {pose_text(self.pose)}." if self.describe_actions else "")
                return StepResult([{"role": "user", "content": [self.view(), {"type": "text", "text": reply}]}],
                                  0.0, False, self.info(action=action.verb))
            action = f"that pose is refused: {reason}"
        self.refusals += 1
        reply = f"Refused: {action}. Your pose is unchanged ({pose_text(self.pose)})."
        return StepResult([{"role": "user", "content": [{"type": "text", "text": reply}]}], 0.0, False,
                          self.info(action="refused"))


# ----------------------------------------------------------------------------- the task


def scene_paths(scene_dir: str) -> list[Path]:
    """The scenes in a folder: its sub-folders (a ScanNet or ARKitScenes scene) and mesh files, by name."""
    root = Path(scene_dir)
    if not root.is_dir():
        raise ValueError(f"task.scene_dir {scene_dir!r} is not a folder; point it at a folder of scene folders "
                         "(ScanNet, ARKitScenes) or mesh files (.ply, .obj, .glb), or unset it for generated rooms")
    paths = sorted(p for p in root.iterdir() if p.is_dir() or p.suffix.lower() in (".ply", ".obj", ".glb", ".gltf"))
    if not paths:
        raise ValueError(f"task.scene_dir {scene_dir!r} holds no scene folders or .ply/.obj/.glb files")
    return paths


@dataclass(frozen=True)
class ScenesTask:
    """The stream of mesh-scene episodes, and the environment that runs them."""

    scene_dir: str | None = None  # None: generated rooms (train and eval from different seeds)
    kinds: tuple[str, ...] = ("color",)
    num_choices: int = 3
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
    render_size: int = 128
    fov_deg: float = 60.0
    start_poses: int = 4
    start_turn: float = 0.0
    say_side: bool = False
    view_fill: float = VIEW_FILL
    start_clear: float = 1.0
    max_turns: int = 3
    turn_cost: float = 0.0
    view_reward: float = 0.0
    require_seen: bool = True
    seen_fraction: float = 0.01
    describe_actions: bool = True
    eval_seed: int = 10_000
    eval_scenes: int = 1  # scene_dir: the last N scenes (by name) are held out
    renderer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in SCENE_QUESTION_KINDS]
        if unknown:
            raise ValueError(f"scene question kinds {unknown} unknown; choose from {', '.join(SCENE_QUESTION_KINDS)}")
        if self.renderer is None:
            from saccade.scenes.render import CachedRenderer, MeshRenderer

            object.__setattr__(self, "renderer", CachedRenderer(MeshRenderer(size=self.render_size, fov_deg=self.fov_deg)))

    # Scenes -----------------------------------------------------------------------------

    def scene(self, index: int, *, seed: int, held_out: bool):
        if self.scene_dir is None:
            return _generated_room(index, seed, tuple(c for c in self.colors if c in GENERATED_COLORS))
        paths = scene_paths(self.scene_dir)
        keep = min(self.eval_scenes, len(paths) - 1)
        split = (paths[len(paths) - keep:] if keep else paths) if held_out else paths[:len(paths) - keep]
        return _loaded_scene(str(split[index % len(split)]))

    def sample(self, index: int, *, seed: int, held_out: bool = False) -> SceneSample:
        """Sample `index` of the stream for `seed`; RowSkipped when its scene offers no question."""
        from saccade.data.rows import RowSkipped

        scene = self.scene(index, seed=seed, held_out=held_out)
        rng = np.random.default_rng([seed, index, 20])
        questions = scene_questions(scene, self.kinds, colors=self.colors, num_choices=self.num_choices)
        while questions:
            q = questions.pop(int(rng.integers(len(questions))))
            poses = start_poses(scene, q["targets"], self.renderer, n=self.start_poses, rng=rng,
                                turn_deg=self.start_turn, fov_deg=self.fov_deg, fill=self.view_fill,
                                clear=self.start_clear)
            if not poses:
                continue  # no start hides these objects: try another question
            start, side = poses[int(rng.integers(len(poses)))]
            question = q["question"]
            if self.say_side and side:
                question = f"{question[:-1]} to your {side}?"
            return SceneSample(f"scenes-{seed}-{index}", scene, question, q["answer"],
                               question_choices(q, rng, self.num_choices), tuple(q["targets"]), start,
                               {"kind": q["kind"], "side": side, "scene": scene.name})
        raise RowSkipped("unusable", f"scene {scene.name!r} offers no {'/'.join(self.kinds)} question with "
                         f"{self.num_choices} options and a start pose that hides its objects", index=index)

    def train_sample(self, position: int, *, seed: int) -> SceneSample:
        return self.sample(position, seed=seed)

    def eval_samples(self, n: int) -> list[SceneSample]:
        return list(_eval_samples(self, n))

    def make_env(self) -> ScenesEnv:
        return ScenesEnv(self.renderer, max_turns=self.max_turns, turn_cost=self.turn_cost,
                         view_reward=self.view_reward, require_seen=self.require_seen,
                         seen_fraction=self.seen_fraction, describe_actions=self.describe_actions)


@lru_cache(maxsize=8)
def _eval_samples(task: ScenesTask, n: int) -> tuple[SceneSample, ...]:
    """The held-out samples, the same every call: the first n usable ones of the eval stream."""
    from saccade.data.rows import RowSkipped

    out, index = [], 0
    while len(out) < n and index < 20 * n + 20:
        try:
            out.append(task.sample(index, seed=task.eval_seed, held_out=True))
        except RowSkipped:
            pass
        index += 1
    return tuple(out)


@lru_cache(maxsize=64)
def _generated_room(index: int, seed: int, colors: tuple[str, ...]):
    from saccade.scenes.generate import generate_room

    return generate_room(index, seed=seed, colors=colors)


@lru_cache(maxsize=16)
def _loaded_scene(path: str):
    from saccade.scenes.loaders import load_scene

    return load_scene(path)


def scripted_replies(sample: SceneSample, rng: np.random.Generator, *, max_turns: int,
                     turn_deg: float = 90.0, turns: tuple[float, ...] | None = None) -> list[str]:
    """Warm-start replies: random valid-looking actions (1 up to max_turns - 1 of them), then a
    random option. They teach the format (act, then answer), not the task: which way to look
    and what the answer is are left to RL. `turns`: the actions are only "turn A left|right"
    for A in turns (each equally likely); None: turn_deg left/right, looks and moves."""
    if turns:
        actions = [f"turn {a:g} {side}" for a in turns for side in ("left", "right")]
    else:
        actions = [f"turn {turn_deg:g} left", f"turn {turn_deg:g} right", "look 15 up", "look 15 down",
                   "move 0.5 forward", "move 0.5 back"]
    n_actions = int(rng.integers(min(1, max_turns - 1), max_turns))
    return [str(rng.choice(actions)) for _ in range(n_actions)] + [str(rng.choice(sample.choices))]
