"""Format ``verl``: verl's RL parquet, the layout of OpenMMReasoner-RL-74K (and of the sets
verl's and EasyR1's preprocessing scripts write).

``prompt`` is the chat (a list of {role, content} messages whose string contents hold
``<image>`` placeholders; a string is one user turn), ``images`` the images in placeholder
order, ``reward_model`` {ground_truth, style}, and ``data_source``, ``avg_reward`` and
``extra_info`` are kept as metadata where a row has them. A multiple-choice ground truth is a
letter whose options are only in the prompt's text: they are parsed out of it
(`parts.parse_options`), so that the reward can read an option's text too.
"""

from __future__ import annotations

from typing import Any

from saccade.data.questions import VQASample
from saccade.data.row_formats import parts
from saccade.data.row_formats.base import RowContext, RowFormat


class Verl(RowFormat):
    name = "verl"
    columns = ("prompt", "images", "reward_model")
    layout = ("prompt (list of {role, content} with <image> placeholders), images (list of images), "
              "data_source, reward_model ({ground_truth, style}), extra_info")

    def read(self, row: dict[str, Any], at: RowContext) -> VQASample:
        """The row's own chat (images at the placeholders), a letter or free-form ground truth,
        options parsed from the prompt for letter answers."""
        messages = parts.chat(row["prompt"], sample_id=at.sample_id)
        reward_model = row["reward_model"] or {}
        answer = parts.answer(reward_model.get("ground_truth"), column="reward_model.ground_truth")
        question = parts.user_text(messages)
        letter = parts.is_letter(answer)
        metadata = {
            "dataset": at.dataset,
            "subset": at.subset or row.get("data_source"),
            "data_source": row.get("data_source"),
            "style": reward_model.get("style"),
            **({"avg_reward": row["avg_reward"]} if row.get("avg_reward") is not None else {}),
            **{f"extra_{k}": v for k, v in parts.scalars(row.get("extra_info")).items()},
        }
        return VQASample(
            sample_id=at.sample_id,
            images=at.images(row["images"], "images"),
            question=question,
            answer=answer,
            choices=parts.parse_options(question) if letter else None,
            answer_type="multi_choice" if letter else "free_form",
            metadata=metadata,
            prompt=messages,
        )
