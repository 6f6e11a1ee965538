"""The data sets saccade knows by name (`task.kind`): each one's hub id, its row format, and
where it trains and evaluates by default. One table, data and not branches: a known data set
in a layout saccade already reads is one entry here (and its name in the config's
`HubDatasetTaskConfig.kind`); a new layout is a new row format (`saccade.data.row_formats`).

* ``openmmreasoner``: OpenMMReasoner-RL-74K, the RL training set. One config per source
  (algopuzzle, mmk12, thinklite_vl_hard, tqa_train, virl39k, wemath_pro, wemath_standard:
  72,971 rows in ``train`` splits) and a ``validation`` config whose split is ``val``
  (1,724 rows). Its rows are verl's RL parquet (format ``verl``).
* ``mathvista``: AI4Math/MathVista ``testmini`` (1,000 rows), format ``mathvista``.
* ``geometry3k``: hiyouga/geometry3k (train 2,101 / validation 300 / test 601), format
  ``problem_answer``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KNOWN_DATASETS", "OPENMMREASONER_TRAIN_SUBSETS", "KnownDataset"]

OPENMMREASONER_TRAIN_SUBSETS = (
    "algopuzzle", "mmk12", "thinklite_vl_hard", "tqa_train", "virl39k", "wemath_pro", "wemath_standard",
)


@dataclass(frozen=True)
class KnownDataset:
    """A data set saccade knows by name. Subsets None: the default config."""

    hub_id: str
    format: str  # its rows' layout: a name in saccade.data.row_formats.ROW_FORMATS
    train_subsets: tuple[str, ...] | None
    train_split: str
    eval_subsets: tuple[str, ...] | None
    eval_split: str


KNOWN_DATASETS: dict[str, KnownDataset] = {
    "openmmreasoner": KnownDataset("OpenMMReasoner/OpenMMReasoner-RL-74K", "verl",
                                   OPENMMREASONER_TRAIN_SUBSETS, "train", ("validation",), "val"),
    "mathvista": KnownDataset("AI4Math/MathVista", "mathvista", None, "testmini", None, "testmini"),
    "geometry3k": KnownDataset("hiyouga/geometry3k", "problem_answer", None, "train", None, "test"),
}
