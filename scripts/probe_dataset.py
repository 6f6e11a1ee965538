"""The data-set demo's supervised probe alone (`saccade.tools.demo_probe.run_probe`), on a data set
in the choices example's columns: do its pictures carry the answers for the tiny model's tower?

    uv run python scripts/probe_dataset.py runs/ds/colors8 200 [--override VALUE ...]

Prints one JSON line: probe_accuracy (SFT on the gold answers, with the pictures), probe_blank_accuracy
(every picture blank), chance, minutes. The run goes to runs/probe/<folder name>/. One torch thread.
"""

import json
import sys
import time
from pathlib import Path

import torch

from saccade.data.choices_example import COLUMNS_JSON
from saccade.run.setup import build_setup
from saccade.run.tasks import task_from_config
from saccade.tools.demo import chance_of, load_demo_config
from saccade.tools.demo_probe import run_probe


def main(argv: list[str]) -> None:
    folder, steps, overrides = argv[0], int(argv[1]), argv[2:]
    torch.set_num_threads(1)
    name = Path(folder).name
    cfg = load_demo_config(["--task.kind", "dataset", "--task.dataset", folder, "--task.columns", COLUMNS_JSON,
                            "--log.dir", f"runs/probe/{name}", "--trainer.torch_threads", "1", *overrides])
    start = time.time()
    setup = build_setup(cfg, cfg.run_dir)
    held_out = task_from_config(cfg).eval_samples(cfg.eval.prompts)
    figures = run_probe(cfg, setup, held_out, steps=steps, progress=False)
    figures.update(chance=chance_of(held_out), minutes=(time.time() - start) / 60, name=name)
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
