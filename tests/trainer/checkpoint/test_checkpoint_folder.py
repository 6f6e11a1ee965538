"""Which of a run's step folders count: the newest before a step, and a stalled run's set aside."""

from __future__ import annotations

import pytest

from saccade.trainer.checkpoint.folder import (
    CHECKPOINTS_DIR,
    COMPLETE,
    PREVIOUS_DIR,
    STATE_FILE,
    STALLED_DIR,
    check_same_base,
    checkpoint_before,
    latest_checkpoint,
    set_aside_checkpoints,
    start_afresh,
)


def _steps(run_dir, complete=(), unfinished=()):
    for step in (*complete, *unfinished):
        folder = run_dir / CHECKPOINTS_DIR / f"step_{step:06d}"
        folder.mkdir(parents=True)
        if step in complete:
            (folder / COMPLETE).write_text("{}")


def test_the_newest_complete_checkpoint_before_a_step(tmp_path):
    _steps(tmp_path, complete=(0, 10, 20), unfinished=(5,))
    assert checkpoint_before(tmp_path, 20) == (10, tmp_path / CHECKPOINTS_DIR / "step_000010")
    assert checkpoint_before(tmp_path, 21)[0] == 20
    assert checkpoint_before(tmp_path, 7)[0] == 0  # step 5 never finished
    assert checkpoint_before(tmp_path, 0) is None
    assert checkpoint_before(tmp_path / "elsewhere", 5) is None


def test_a_stalled_runs_checkpoints_are_set_aside_and_kept(tmp_path):
    _steps(tmp_path, complete=(10, 20, 30), unfinished=(40,))
    moved = set_aside_checkpoints(tmp_path, 20)
    assert [p.name for p in moved] == ["step_000020", "step_000030", "step_000040"]
    assert all(p.parent == tmp_path / STALLED_DIR and p.is_dir() for p in moved)
    assert latest_checkpoint(tmp_path) == tmp_path / CHECKPOINTS_DIR / "step_000010"  # what --resume loads
    # The same steps stalling again (after a --resume from step 10) keep the first ones too.
    _steps(tmp_path, complete=(20,))
    again = set_aside_checkpoints(tmp_path, 15)
    assert [p.name for p in again] == ["step_000020.1"]
    assert (tmp_path / STALLED_DIR / "step_000020" / COMPLETE).is_file()
    assert set_aside_checkpoints(tmp_path, 11) == []


def test_a_new_run_in_a_folder_with_another_runs_checkpoints_is_refused(tmp_path):
    _steps(tmp_path, complete=(1, 2), unfinished=(3,))
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(step_000001, step_000002, step_000003\): "
                       r"go on with that run with --resume.*--fresh"):
        start_afresh(tmp_path, fresh=False, stamp="t")
    assert latest_checkpoint(tmp_path) == tmp_path / CHECKPOINTS_DIR / "step_000002"  # untouched


def test_fresh_moves_another_runs_checkpoints_aside(tmp_path):
    _steps(tmp_path, complete=(1, 2), unfinished=(3,))
    moved = start_afresh(tmp_path, fresh=True, stamp="t")
    assert [p.name for p in moved] == ["step_000001", "step_000002", "step_000003"]
    assert all(p.parent == tmp_path / PREVIOUS_DIR / "t" for p in moved)
    assert latest_checkpoint(tmp_path) is None  # --resume cannot load the old run by accident
    assert start_afresh(tmp_path, fresh=False, stamp="t") == []  # an empty folder: nothing to refuse


def test_a_resume_on_another_base_model_is_refused_saying_both(tmp_path):
    import json

    step = tmp_path / "step_000002"
    step.mkdir()
    (step / STATE_FILE).write_text(json.dumps({"checkpoint": {"base_model_path": "Qwen/Qwen2.5-VL-3B-Instruct"}}))
    check_same_base(step, "Qwen/Qwen2.5-VL-3B-Instruct")  # the same: goes on
    with pytest.raises(ValueError, match=r"trained from base model Qwen/Qwen2.5-VL-3B-Instruct, but this config's "
                       r"model is Qwen/Qwen2.5-VL-7B-Instruct: resume with --model.path Qwen/Qwen2.5-VL-3B-Instruct"):
        check_same_base(step, "Qwen/Qwen2.5-VL-7B-Instruct")
    (tmp_path / "model").mkdir()
    (step / STATE_FILE).write_text(json.dumps({"checkpoint": {"base_model_path": str(tmp_path / "model")}}))
    (tmp_path / "link").symlink_to(tmp_path / "model")
    check_same_base(step, str(tmp_path / "link"))  # one folder, two names
