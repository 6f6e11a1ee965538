"""The `[task]` section: where a run's prompts come from, one variant per kind of task.

`kind` picks the variant, and each variant holds the fields its task reads, and only those:

- "shapes": synthetic shapes questions, answered by choice (`saccade.data.shapes`);
- "views": multi-turn view selection in a raycast room (`saccade.envs.views`);
- "scenes": multi-turn questions about mesh scenes (`saccade.envs.scenes`);
- "openmmreasoner", "mathvista", "geometry3k": those data sets, read from the hub or a copy;
- "dataset": your own data set, read through `columns` or in a known row `format` (docs/data.md);
- "verifiers": a verifiers environment by its id, `env_args` its taskset's config;
- "plugin": your own Task, `make_task(cfg)` (docs/rewards.md).

`saccade.run.tasks.task_from_config` builds the task from its variant. A variant checks only what
it can check without importing any task code: a user's module or a verifiers environment is
looked up by `saccade.run.tasks.check_user_code`, which the entry points run before anything is
built (`--dry-run` included).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from saccade.config.sections import Section
from saccade.plugins import IMPORT_PATH
from saccade.rewards.protocols import EXTRACTORS, GRADERS

SHAPES_QUESTION_KINDS = ["color", "shape", "count"]
# The same list as saccade.envs.scenes.SCENE_QUESTION_KINDS (a test keeps them equal).
SCENE_QUESTION_KINDS = ["color", "count", "on"]
VIEW_PLACES = ("left", "right", "ceiling", "floor", "far")
# The same list as saccade.data.shapes.COLORS, repeated so that --dry-run catches a typo
# without importing the renderer (tests/test_config.py checks the two agree).
VIEW_COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
# Mesh scenes also name scanned objects' neutral colours (saccade.scenes.mesh.SCENE_COLORS).
SCENE_COLORS = (*VIEW_COLORS, "white", "gray", "black", "brown")
KIND = "which task: its fields follow (docs/config.md lists every kind's)"


def check_kinds(kinds: list[str], known: list[str], task: str) -> None:
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise ValueError(f"question_kinds {unknown} unknown to task kind {task!r}; choose from {', '.join(known)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"question_kinds {kinds} repeat an entry")


def check_colors(colors: list[str], known: tuple[str, ...], num_choices: int) -> None:
    unknown = [c for c in colors if c not in known]
    if unknown:
        raise ValueError(f"colors {unknown} unknown; choose from {', '.join(known)}")
    if len(set(colors)) != len(colors):
        raise ValueError(f"colors {colors} repeat an entry")
    if num_choices > len(colors):
        raise ValueError(f"num_choices = {num_choices} color options need at least as many colors, got "
                         f"{colors}: lower num_choices or add colors")


def num_choices_field() -> Any:
    return Field(4, ge=3, le=6, description="answer options per question")


def max_turns_field() -> Any:
    return Field(3, ge=1, le=64, description="assistant turns per episode at most")


class ShapesTaskConfig(Section):
    """Synthetic shapes questions, built on the spot: what color, what shape, how many."""

    kind: Literal["shapes"] = Field("shapes", description=KIND)
    question_kinds: list[str] = Field(
        default_factory=lambda: ["color"], min_length=1,
        description=f"kinds of question asked about each image ({', '.join(SHAPES_QUESTION_KINDS)})",
    )
    num_choices: int = num_choices_field()
    image_size: int = Field(64, ge=32, le=4096, description="side of the generated square images, pixels")
    blank_images: bool = Field(
        False, description="replace every image by a blank one: the control run, which must not learn"
    )

    @model_validator(mode="after")
    def _known_kinds(self) -> ShapesTaskConfig:
        check_kinds(self.question_kinds, SHAPES_QUESTION_KINDS, self.kind)
        return self


class ViewsTaskConfig(Section):
    """Multi-turn view selection: look around a raycast room, then say the object's color."""

    kind: Literal["views"] = Field("views", description=KIND)
    num_choices: int = num_choices_field()
    max_turns: int = max_turns_field()
    turn_cost: float = Field(0.0, ge=0, le=1, description="reward subtracted per extra turn taken")
    require_seen: bool = Field(True, description="an answer counts only once the object has been in view")
    colors: list[str] = Field(
        default_factory=lambda: list(VIEW_COLORS), min_length=3,
        description=f"the objects' colors, and so the answers ({', '.join(VIEW_COLORS)})",
    )
    places: list[str] = Field(
        default_factory=lambda: list(VIEW_PLACES), min_length=1,
        description="where the asked-about object may be (left, right, ceiling, floor, far)",
    )
    image_size: int = Field(64, ge=32, le=1024, description="side of the rendered square views, pixels")
    distractors: int = Field(2, ge=0, le=4, description="objects in the start view (never the answer's color)")
    look_reward: float = Field(
        0.0, ge=0, le=1, description="per-turn reward for the action that first brings the object into view"
    )

    @model_validator(mode="after")
    def _known_places_and_colors(self) -> ViewsTaskConfig:
        unknown = [p for p in self.places if p not in VIEW_PLACES]
        if unknown:
            raise ValueError(f"places {unknown} unknown; choose from {', '.join(VIEW_PLACES)}")
        check_colors(self.colors, VIEW_COLORS, self.num_choices)
        if len(self.colors) <= self.distractors:
            raise ValueError(f"{self.distractors} distractors need more than {len(self.colors)} colors: "
                             "lower distractors or add colors")
        return self


class ScenesTaskConfig(Section):
    """Multi-turn questions about mesh scenes (generated rooms, or scanned ones): turn, move, answer."""

    kind: Literal["scenes"] = Field("scenes", description=KIND)
    question_kinds: list[str] = Field(
        default_factory=lambda: ["color"], min_length=1,
        description=f"kinds of question asked about each scene ({', '.join(SCENE_QUESTION_KINDS)})",
    )
    num_choices: int = num_choices_field()
    max_turns: int = max_turns_field()
    turn_cost: float = Field(0.0, ge=0, le=1, description="reward subtracted per extra turn taken")
    require_seen: bool = Field(True, description="an answer counts only once the objects have been in view")
    colors: list[str] = Field(
        default_factory=lambda: list(VIEW_COLORS), min_length=3,
        description=f"the objects' colors, and so the color answers ({', '.join(SCENE_COLORS)})",
    )
    scene_dir: str | None = Field(
        None, min_length=1,
        description="a folder of scenes loaded with saccade.scenes.loaders.load_scene (ScanNet or "
        "ARKitScenes scene folders, .ply/.obj/.glb files); unset: generated rooms, training and held-out rooms "
        "from different seeds",
    )
    eval_scenes: int = Field(
        1, ge=0, le=100_000,
        description="with scene_dir: the last this many scenes (by name) are held out for evaluation; "
        "0: evaluate on the training scenes (questions from another seed)",
    )
    render_size: int = Field(128, ge=32, le=1024, description="side of the rendered square views, pixels")
    fov_deg: float = Field(60.0, ge=20, le=120, description="the camera's horizontal field of view, degrees")
    start_poses: int = Field(
        4, ge=1, le=64,
        description="candidate start poses per question (valid, not showing the asked-about objects); "
        "each episode starts from one of them",
    )
    start_turn: float = Field(
        0.0, ge=0, le=180,
        description="0: start poses anywhere in the room; > 0: each start pose is a good view of the "
        "objects turned away by this many degrees, so one 'turn <start_turn> left/right' shows them",
    )
    say_side: bool = Field(
        False, description="with start_turn > 0: the question says which side the objects are on "
        "('What color is the chair to your left?')",
    )
    view_fill: float = Field(
        0.9, gt=0, le=4,
        description="with start_turn > 0: the view a start turns away from frames the objects' box to "
        "this share of the view's width (above 1: closer, the objects overflow the view)",
    )
    start_clear: float = Field(
        1.0, ge=0, le=1,
        description="a start view may show other labelled objects on at most this fraction of its "
        "pixels (1: no limit; the views demo's 'no distractors' is about 0.01)",
    )
    view_reward: float = Field(
        0.0, ge=0, le=10,
        description="weight of the largest fraction of the image the asked-about objects covered in "
        "any view, added to the answering turn's reward",
    )
    seen_fraction: float = Field(
        0.01, ge=0, le=1,
        description="the objects count as seen (require_seen) once they cover this fraction of a view",
    )
    describe_actions: bool = Field(
        True, description="the prompt lists the action grammar (off for the tiny demo model, which "
        "copies from such lists)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ScenesTaskConfig:
        check_kinds(self.question_kinds, SCENE_QUESTION_KINDS, self.kind)
        check_colors(self.colors, SCENE_COLORS, self.num_choices if "color" in self.question_kinds else 0)
        if self.say_side and self.start_turn == 0:
            raise ValueError("say_side needs start_turn > 0: only then is the asked-about object on one side of "
                             "the start view")
        return self


PROMPT_TEMPLATE_FIELDS = ("prompt", "choices")
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n{choices}"
IMAGE_PLACEHOLDER = "<image>"


def check_prompt_template(template: str) -> None:
    """Refuse a template that names anything but {prompt} and {choices}, or not {prompt}."""
    import string

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as err:  # an unmatched brace
        raise ValueError(f"task.prompt_template {template!r}: {err}; write {{{{ and }}}} for literal braces") from None
    for name, spec, conv in fields:
        if name not in PROMPT_TEMPLATE_FIELDS or spec or conv:
            raise ValueError(f"task.prompt_template {template!r} names {{{name}{'!' + conv if conv else ''}"
                             f"{':' + spec if spec else ''}}}; it may name only {{prompt}} and {{choices}} (write "
                             "{{ and }} for literal braces)")
    if "prompt" not in [name for name, _, _ in fields]:
        raise ValueError(f"task.prompt_template {template!r} does not name {{prompt}}: the question would never "
                         "reach the model")


class ColumnsConfig(Section):
    """Task 'dataset': the data set's column names for each part of a question.

    ``images`` holds one image or a list of them (Image feature structs, paths relative to
    the data file, or bytes); ``<image>`` placeholders in the prompt place them, else they go
    first. ``videos`` holds one clip a row: a video file (a path relative to the data file, or
    bytes) or a list of frames; ``<video>`` placeholders place it, else it goes first. ``choices``
    is a list column of options. Unset optional columns are not read."""

    prompt: str = Field("question", min_length=1, description="the question text (may hold <image> placeholders)")
    answer: str = Field("answer", min_length=1, description="the ground truth: option text or letter, number, text")
    images: str = Field("image", min_length=1, description="the image, or list of images, of each row")
    choices: str | None = Field(
        None, min_length=1, description="a list column of answer options; unset: free-form answers"
    )
    videos: str | None = Field(
        None, min_length=1, description="a clip per row: a video file (a path under the data set's folder, or bytes) "
        "or a list of frames, sampled by [images.video] (<video> placeholders place it); unset: no clips"
    )
    id: str | None = Field(
        None, min_length=1, description="the rows' own ids, used in eval samples and skipped.jsonl; "
        "unset: dataset-<split>-<index>"
    )
    category: str | None = Field(
        None, min_length=1, description="a category per row (text, or a list of them): saccade eval reports "
        "accuracy per category"
    )


class ScoringConfig(Section):
    """How `correct` scores a data set's rows: an extractor pulls the answer out of the reply, a
    grader compares it with the ground truth (the published protocols: docs/recipes.md). The
    format checks are reward functions of their own, weighted in `rollout.reward_weights`
    (think_boxed, easyr1_format, think_answer)."""

    extractor: Literal[EXTRACTORS] = Field(
        "saccade", description="saccade: a think block dropped, then the last \\boxed{}, 'Answer:' or the last line; "
        "boxed: mathruler's last \\boxed{} ('None' without one; verl geo3k); easyr1: the same after EasyR1's "
        "whitespace squeeze around <, > and /; answer_tag: OpenMMReasoner's first <answer>...</answer>, else the "
        "last box, else a trailing number; mathvista: MathVista's rules, then the judge (judge_url) or saccade's",
    )
    grader: Literal[GRADERS] = Field(
        "saccade", description="saccade: options, numbers, MathVista types, math-verify, text; mathruler: "
        "mathruler's grade_answer (EasyR1, verl); openmmreasoner: its relaxed match and letter parser, then "
        "math-verify (an option-text gold graded as its letter); mathvista: the official normalisation (nearest "
        "option by edit distance, int, float at the row's precision) and string equality",
    )
    judge_url: str | None = Field(
        None, min_length=1, description="extractor mathvista: an OpenAI-compatible endpoint (.../v1) asked with "
        "MathVista's official extraction prompt where its rules find no answer; unset: saccade's extraction there",
    )
    judge_model: str = Field("gpt-4o-mini", min_length=1, description="the model judge_url serves")
    judge_api_key_env: str | None = Field(
        None, min_length=1, description="the environment variable holding judge_url's API key; unset: none sent"
    )

    @model_validator(mode="after")
    def _judge_with_mathvista(self) -> ScoringConfig:
        if self.judge_url is not None and self.extractor != "mathvista":
            raise ValueError(f"task.scoring.judge_url is read by extractor 'mathvista' only, and extractor is "
                             f"{self.extractor!r}: set extractor = 'mathvista' or remove judge_url")
        return self


class HubDatasetTaskConfig(Section):
    """A known data set (OpenMMReasoner-RL-74K, MathVista, Geometry3K), read through Hugging Face
    `datasets` from its hub id or a local copy; every unset field takes the data set's default."""

    # The names of saccade.data.known_datasets.KNOWN_DATASETS (a test keeps them equal).
    kind: Literal["openmmreasoner", "mathvista", "geometry3k"] = Field(
        "openmmreasoner", description="openmmreasoner: OpenMMReasoner-RL-74K (training); mathvista: MathVista "
        "testmini (evaluation); geometry3k: Geometry3K",
    )
    dataset: str | None = Field(
        None, min_length=1,
        description="hub id, local folder laid out like a hub repository, or parquet / JSONL file(s) (a path or "
        "glob) of the data set; unset: the data set's hub id (OpenMMReasoner/OpenMMReasoner-RL-74K, "
        "AI4Math/MathVista, hiyouga/geometry3k)",
    )
    split: str = Field("train", min_length=1, description="dataset split to train on")
    subsets: list[str] | None = Field(
        None, min_length=1,
        description="dataset configs to train on, rows concatenated; unset: openmmreasoner's seven training "
        "configs (algopuzzle, mmk12, thinklite_vl_hard, tqa_train, virl39k, wemath_pro, wemath_standard), "
        "else the default config",
    )
    eval_dataset: str | None = Field(
        None, min_length=1, description="hub id or path of the held-out data set; unset: the same as dataset"
    )
    eval_split: str | None = Field(
        None, min_length=1, description="held-out split; unset: openmmreasoner 'val', mathvista 'testmini', "
        "geometry3k 'test'",
    )
    eval_subsets: list[str] | None = Field(
        None, min_length=1,
        description="held-out configs; unset: openmmreasoner ['validation'], else the default config",
    )
    blank_images: bool = Field(
        False, description="replace every image by a blank one: the control run, which must not learn"
    )
    max_skip_fraction: float = Field(
        0.05, ge=0, lt=1,
        description="stop the run when more than this share of the last 200 rows read were skipped as broken "
        "(each skipped row is listed in <run_dir>/skipped.jsonl; saccade.data.rows)",
    )
    prompt_template: str = Field(
        "{prompt}", min_length=1,
        description="the last user turn's text, a str.format template over {prompt} (the row's text, trimmed; "
        "required) and {choices} (the options lettered A., B., ... one a line); the text is stripped. EasyR1's "
        "math prompt: '{prompt} You FIRST think ...' (docs/recipes.md). Write {{ and }} for literal braces",
    )
    system_prompt: str | None = Field(
        None, min_length=1, description="the system turn of every prompt whose row has none; unset: none added"
    )
    scoring: ScoringConfig = Field(
        default_factory=ScoringConfig, description="how `correct` scores a reply: the extractor and the grader"
    )

    @model_validator(mode="after")
    def _no_repeats(self) -> HubDatasetTaskConfig:
        for name in ("subsets", "eval_subsets"):
            names = getattr(self, name)
            if names is not None and len(set(names)) != len(names):
                raise ValueError(f"{name} {names} repeat an entry")
        return self

    @model_validator(mode="after")
    def _prompt_parts(self) -> HubDatasetTaskConfig:
        if self.prompt_template is not None:
            check_prompt_template(self.prompt_template)
        if self.system_prompt is not None and IMAGE_PLACEHOLDER in self.system_prompt:
            raise ValueError(f"task.system_prompt holds {IMAGE_PLACEHOLDER}: images go in the user turn; put the "
                             "placeholder in the prompt column or task.prompt_template")
        return self


class OwnDatasetTaskConfig(HubDatasetTaskConfig):
    """Your own data set (docs/data.md): a hub id, a folder, or parquet / JSONL files, whose
    columns say which part of a question each holds (`columns`), or whose rows are in a layout
    saccade reads whole (`format`)."""

    kind: Literal["dataset"] = Field("dataset", description=KIND)
    dataset: str = Field(
        min_length=1,
        description="hub id, local folder laid out like a hub repository, or parquet / JSONL file(s) (a path or "
        "glob) of the data set",
    )
    eval_split: str | None = Field(
        None, min_length=1,
        description="held-out split; unset: 'test' when the eval data set has it, else 'validation', else "
        "refused (a single file has no held-out split: set eval_dataset to another file, or eval_split to "
        "'train' to evaluate on the training rows)",
    )
    eval_subsets: list[str] | None = Field(None, min_length=1, description="held-out configs; unset: the default config")
    subsets: list[str] | None = Field(
        None, min_length=1, description="dataset configs to train on, rows concatenated; unset: the default config"
    )
    format: str = Field(
        "columns", min_length=1,
        description="how a row is laid out: 'columns', the columns task.columns names; or a layout saccade reads "
        "whole, as a known data set's: 'verl' (verl's RL parquet, OpenMMReasoner's), 'mathvista', 'problem_answer' "
        "(Geometry3K's), 'video_r1' (Video-R1-260k's image and clip rows), ... (docs/data.md#row-formats lists them)",
    )
    columns: ColumnsConfig = Field(
        default_factory=ColumnsConfig, description="format 'columns': which column holds what (the prompt, the "
        "answer, the images, ...)"
    )
    prompt_template: str | None = Field(
        None, min_length=1,
        description="the user turn's text, a str.format template over {prompt} (the prompt column, or the row's "
        "last user turn trimmed; required) and {choices} (the options lettered A., B., ... one a line; empty "
        "without options); the text is stripped. Write {{ and }} for literal braces. Unset: format 'columns' "
        f"{DEFAULT_PROMPT_TEMPLATE!r}, the prompt and then its options; the other formats '{{prompt}}', the row's "
        "own text",
    )
    system_prompt: str | None = Field(
        None, min_length=1, description="the system turn of every prompt (format 'columns'; the other formats: of "
        "every prompt whose row has none); unset: none"
    )
    image_root: str | None = Field(
        None, min_length=1,
        description="the folder image files named in the rows may be read from (symlinks resolved); unset: the data "
        "set's own folder (a file's folder, a folder source itself; none for a hub id). A row naming a file "
        "elsewhere is skipped as image_outside_dataset",
    )

    @model_validator(mode="after")
    def _columns_with_their_format(self) -> OwnDatasetTaskConfig:
        if self.format != "columns" and self.columns != ColumnsConfig():
            raise ValueError(f"task.columns is read by format 'columns' only, and format is {self.format!r}, "
                             "which reads its own columns: remove task.columns, or set format = 'columns'")
        return self


class VerifiersTaskConfig(Section):
    """An environment written for the `verifiers` package (0.4, its v1 API), built by its own
    `load_environment` with `env_args` as the taskset's config, and run through
    `saccade.envs.verifiers_env`."""

    kind: Literal["verifiers"] = Field("verifiers", description=KIND)
    env_id: str = Field(min_length=1, description="the environment's id, e.g. 'my-env' (its module: my_env)")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="the taskset's config: fields of its TasksetConfig"
    )
    max_turns: int = Field(
        3, ge=1, le=64, description="assistant turns per episode at most: caps the seat's own max_turns"
    )
    correct_metric: str | None = Field(
        None, min_length=1,
        description="the reward or metric whose value counts as success (accuracy metrics); unset: accuracy "
        "stays 0 and the rewards and metrics are logged as env_<name>",
    )


class PluginTaskConfig(Section):
    """Your own Task: `make_task(cfg)` is called with the whole run config and returns one
    (`saccade.run.tasks.Task`; docs/rewards.md)."""

    kind: Literal["plugin"] = Field("plugin", description=KIND)
    make_task: str = Field(
        min_length=1, description="your function as 'package.module:make_task' (found on sys.path)"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="anything your make_task reads, as cfg.task.args"
    )

    @field_validator("make_task")
    @classmethod
    def _import_path(cls, path: str) -> str:
        if not IMPORT_PATH.match(path):
            raise ValueError(f"{path!r} is not an import path; write 'package.module:make_task' (dotted module, "
                             "one colon, the function's name)")
        return path


TaskConfig = Annotated[
    ShapesTaskConfig | ViewsTaskConfig | ScenesTaskConfig | HubDatasetTaskConfig | OwnDatasetTaskConfig
    | VerifiersTaskConfig | PluginTaskConfig,
    Field(discriminator="kind"),
]
# The tasks an eval set may be (`eval.sets`): question data sets, each scored by its own task.scoring.
DatasetTaskConfig = Annotated[HubDatasetTaskConfig | OwnDatasetTaskConfig, Field(discriminator="kind")]
TASK_CONFIGS = (ShapesTaskConfig, ViewsTaskConfig, ScenesTaskConfig, HubDatasetTaskConfig, OwnDatasetTaskConfig,
                VerifiersTaskConfig, PluginTaskConfig)
# Their kinds are saccade.data.rows.DATASET_TASKS (a test keeps the two equal).
DATASET_CONFIGS = (HubDatasetTaskConfig, OwnDatasetTaskConfig)
