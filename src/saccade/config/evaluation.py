"""The `[eval]` section: periodic evaluation on the training task's held-out prompts, and on
more held-out sets of other tasks (`sets`), each scored by its own task's protocol."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from saccade.config.sections import Section
from saccade.config.task import DatasetTaskConfig

SET_NAME = r"[A-Za-z][A-Za-z0-9_]*"


class EvalConfig(Section):
    """Periodic evaluation on the held-out prompts."""

    every_steps: int = Field(10, ge=0, description="evaluate (greedy decoding) every this many steps; 0: never")
    prompts: int = Field(
        64, ge=0, description="held-out prompts evaluated; data sets: the first this many rows of the eval split"
    )
    samples_k: int = Field(
        1, ge=1, le=1024, description="saccade eval: samples per prompt at sampling.temperature, for pass@k and mean@k (n)"
    )
    visual_gain: bool = Field(
        True, description="score the held-out prompts again with every image blank (uniform gray, same size): "
        "logs eval_accuracy_blank and visual_gain = eval_accuracy - eval_accuracy_blank, how much of the success "
        "the images bring. Costs a second greedy decode of the prompts: 2.1x the eval's time on the demo config "
        "(64 prompts, embedded engine, CPU)",
    )
    sets: dict[str, DatasetTaskConfig] = Field(
        default_factory=dict,
        description="more held-out sets, evaluated beside the training task's own: a name (letters, digits, '_'; "
        "--eval.sets.<name>.<field> on the command line) and a data set task's keys, those of task.* for kinds "
        "openmmreasoner, mathvista, geometry3k and dataset ([eval.sets.mathvista] kind = 'mathvista', ...), each "
        "set scored by its own scoring; logged as eval <name>_accuracy, reported by saccade eval under 'sets'",
    )

    @field_validator("sets")
    @classmethod
    def _set_names(cls, sets: dict[str, Any]) -> dict[str, Any]:
        for name in sets:
            if not re.fullmatch(SET_NAME, name):
                raise ValueError(f"eval set name {name!r}: use letters, digits and '_' (it is a metric's prefix and "
                                 "a key of --eval.sets.<name>.<field>)")
        return sets

