"""Tests for saccade.data.rows: broken data set rows are skipped with their reason, listed in
skipped.jsonl, counted per step, judged over a window, reported apart by eval, and a run killed
at any instant resumes with each skipped row listed exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dataset_fixtures import BROKEN_KINDS, BROKEN_LIMITS, picture, write_broken_geometry3k

from saccade.config import ImagesConfig, RunConfig, load_config
from saccade.data.datasets import DatasetRows, shuffled_index
from saccade.data.rows import (
    SKIP_REASONS,
    SKIP_WINDOW_ROWS,
    SKIPPED_FILE,
    RowSkipped,
    SkipLog,
    SkipWindow,
    TooManySkippedRows,
    open_prompt_stream,
    prompt_tokens,
    read_skipped,
    token_budget,
)

SRC = Path(__file__).resolve().parents[2] / "src"
# Six good rows, then one of each broken kind: half the rows are broken.
KINDS = ["good"] * 6 + list(BROKEN_KINDS)


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    return write_broken_geometry3k(tmp_path_factory.mktemp("broken") / "geometry3k", KINDS)


def test_the_fixture_holds_one_row_of_each_reason():
    assert sorted(BROKEN_KINDS) == sorted(SKIP_REASONS)


def test_each_broken_row_is_refused_with_its_reason_and_place(broken, processor):
    rows = DatasetRows("geometry3k", str(broken), subsets=None, split="train", limits=ImagesConfig(max_source_pixels=4096))
    fits = token_budget(processor, rows.limits, max_tokens=256, completion_tokens=4)
    reasons = {}
    for i in range(len(rows)):
        try:
            fits(rows.sample(i))
        except RowSkipped as err:
            reasons[i] = err.reason
            assert (err.row_id, err.split, err.index) == (f"geometry3k-train-{i}", "train", i)
    assert reasons == {i: kind for i, kind in enumerate(KINDS) if kind != "good"}


@pytest.mark.parametrize("sizes", [[(56, 48)], [(1024, 768)], [(20, 300), (640, 64)], [(33, 33), (2000, 40)]])
def test_prompt_tokens_count_what_the_processor_makes(processor, sizes):
    from saccade.data.messages import messages_to_inputs
    from saccade.data.questions import VQASample, to_messages

    limits = ImagesConfig(min_pixels=32 * 32, max_pixels=128 * 128)
    marks = " and ".join("<image>" for _ in sizes)
    sample = VQASample("q", [picture(i, size=size) for i, size in enumerate(sizes)], "q", "1", None, "free_form",
                       prompt=[{"role": "user", "content": f"Compare {marks}: find x."}])
    made = messages_to_inputs(to_messages(sample), processor, limits=limits, add_generation_prompt=True)
    assert prompt_tokens(sample, processor, limits) == made.input_ids.numel()


# ------------------------------------------------------------------------ the stream


def list_reader(kinds: list[str]):
    """Position -> a row of `kinds`, round and round; broken ones refused with their kind."""

    def read(position: int) -> str:
        kind = kinds[position % len(kinds)]
        if kind != "good":
            raise RowSkipped(kind, "as written", row_id=f"row-{position % len(kinds)}", split="train",
                             index=position % len(kinds))
        return f"prompt-{position}"

    return read


def test_a_step_is_refilled_past_broken_rows_and_each_skip_listed(tmp_path):
    kinds = ["good", "bad_image", "good", "no_answer", "too_long", "good", "good"]
    with open_prompt_stream(list_reader(kinds), run_dir=tmp_path, position=0, done_steps=0, resume=False,
                            max_skip_fraction=0.05) as stream:
        first = stream.take(2, step=1)
        second = stream.take(2, step=2)
    assert (first.prompts, first.positions, first.end) == (["prompt-0", "prompt-2"], [0, 2], 3)
    assert (second.prompts, second.positions, second.end) == (["prompt-5", "prompt-6"], [5, 6], 7)
    assert [r["reason"] for r in second.skipped] == ["no_answer", "too_long"]
    listed = read_skipped(tmp_path)
    assert [(r["step"], r["position"], r["id"], r["reason"]) for r in listed] == [
        (1, 1, "row-1", "bad_image"), (2, 3, "row-3", "no_answer"), (2, 4, "row-4", "too_long")]


def test_no_file_when_no_row_is_broken(tmp_path):
    with open_prompt_stream(list_reader(["good"]), run_dir=tmp_path, position=0, done_steps=0, resume=False,
                            max_skip_fraction=0.05) as stream:
        stream.take(5, step=1)
    assert not (tmp_path / SKIPPED_FILE).exists()


def test_the_window_judges_only_a_full_window():
    window = SkipWindow(max_fraction=0.05, rows=20)
    for position in range(5):  # 5 of the first 19 rows broken: 26%, but the window is not full yet
        window.add(position, "bad_image")
    window.judge(19)
    with pytest.raises(TooManySkippedRows, match=r"5 of the last 20 .* \(25\.0%\)"):
        window.judge(20)
    with pytest.raises(TooManySkippedRows, match="3 of the last 20"):
        window.judge(22)  # two of them slid out of the window: 3 of 20 = 15%, still over
    window = SkipWindow(max_fraction=0.05, rows=20)
    window.add(3, "bad_image")
    window.judge(20)  # 1 of 20 = 5% is not above 5%


def test_a_stream_half_broken_stops_naming_the_commonest_reason(tmp_path):
    kinds = ["good", "bad_image", "good", "bad_image", "good", "no_answer", "good", "bad_image"]
    stream = open_prompt_stream(list_reader(kinds), run_dir=tmp_path, position=0, done_steps=0, resume=False,
                                max_skip_fraction=0.05)
    with pytest.raises(TooManySkippedRows, match=r"commonest reason is bad_image .*" + SKIPPED_FILE):
        stream.take(1000, step=1)
    assert stream.position == SKIP_WINDOW_ROWS  # stopped as soon as the window was full
    assert len(read_skipped(tmp_path)) == SKIP_WINDOW_ROWS // 2  # the rows it names are listed


def test_a_resumed_log_drops_later_steps_and_a_torn_line(tmp_path):
    log = SkipLog(tmp_path, resume=False)
    for step in (1, 2, 2, 3):
        log.write({"step": step, "position": step, "reason": "bad_image"})
    log.close()
    with open(tmp_path / SKIPPED_FILE, "ab") as f:
        f.write(b'{"step": 3, "posit')  # what a kill in the middle of a write leaves
    SkipLog(tmp_path, resume=True, keep_through_step=2).close()
    assert [r["step"] for r in read_skipped(tmp_path)] == [1, 2, 2]
    assert (tmp_path / SKIPPED_FILE).read_bytes().endswith(b"}\n")


def test_a_fresh_run_sets_an_old_list_aside(tmp_path):
    SkipLog(tmp_path, resume=False).write({"step": 1, "position": 0, "reason": "no_answer"})
    SkipLog(tmp_path, resume=False).close()
    assert not (tmp_path / SKIPPED_FILE).exists() and (tmp_path / f"{SKIPPED_FILE}.1").exists()


def test_the_resumed_window_is_rebuilt_from_the_list(tmp_path):
    kinds = ["good", "bad_image"]  # 50% broken: the window fills at row 200 and stops the run
    with open_prompt_stream(list_reader(kinds), run_dir=tmp_path, position=0, done_steps=0, resume=False,
                            max_skip_fraction=0.05) as stream:
        for step in range(1, 10):
            stream.take(10, step=step)
    assert stream.position == 179
    # Resumed after step 9 at row 179: the skips already in the window count, so it stops at 200 too.
    resumed = open_prompt_stream(list_reader(kinds), run_dir=tmp_path, position=179, done_steps=9, resume=True,
                                 max_skip_fraction=0.05)
    with pytest.raises(TooManySkippedRows, match="100 of the last 200"):
        resumed.take(100, step=10)
    assert resumed.position == 200


# A child that reads a stream with broken rows, "checkpoints" (step, position) every other
# step, and resumes from its checkpoint when one is there; its parent kills it with SIGKILL.
STREAM_CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {src!r})
    from saccade.data.rows import RowSkipped, open_prompt_stream
    run_dir, kinds, steps = sys.argv[1], "good good bad_image good no_answer too_long".split(), 60
    def read(position):
        i = position % len(kinds)
        if kinds[i] != "good":
            raise RowSkipped(kinds[i], "x" * 200, row_id=f"row-{{i}}", split="train", index=i)
        return position
    checkpoint = os.path.join(run_dir, "checkpoint.json")
    state = json.load(open(checkpoint)) if os.path.exists(checkpoint) else {{"step": 0, "position": 0}}
    with open_prompt_stream(read, run_dir=run_dir, position=state["position"], done_steps=state["step"],
                            resume=state["step"] > 0, max_skip_fraction=0.9) as stream:
        for step in range(state["step"], steps):
            rows = stream.take(3, step=step + 1)
            if (step + 1) % 2 == 0:
                with open(checkpoint + ".tmp", "w") as f:
                    json.dump({{"step": step + 1, "position": rows.end}}, f)
                os.replace(checkpoint + ".tmp", checkpoint)
            print(step + 1, flush=True)
""")


def test_a_stream_killed_at_any_instant_resumes_with_each_skip_listed_once(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(STREAM_CHILD.format(src=str(SRC)))
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run([sys.executable, str(script), str(straight)], check=True, capture_output=True, timeout=120)
    expected = (straight / SKIPPED_FILE).read_bytes()
    # 60 steps of 3 good rows: 60 rounds of the 6 rows, less the 2 broken ones after the last good row.
    assert len(read_skipped(straight)) == 60 * 3 - 2

    for attempt, delay in enumerate((0.0, 0.003, 0.011)):  # kills at different instants of the run
        run = tmp_path / f"killed-{attempt}"
        run.mkdir()
        child = subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.PIPE, text=True)
        for line in child.stdout:  # let it get going, then kill it mid-stream
            if int(line) >= 10:
                break
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        assert child.returncode == -signal.SIGKILL
        subprocess.run([sys.executable, str(script), str(run)], check=True, capture_output=True, timeout=120)
        assert (run / SKIPPED_FILE).read_bytes() == expected, f"kill {attempt}"


# ------------------------------------------------------------------------ RL and eval


def _seed_reading_every_row_once(kinds: list[str]) -> int:
    """A trainer seed whose first epoch ends on a good row: a run that needs every good row of
    the epoch then reads each broken row exactly once."""
    n = len(kinds)
    return next(s for s in range(1000) if kinds[shuffled_index(n - 1, n, seed=s)] == "good")


def _config(dataset: Path, run_dir: Path, *extra: str) -> RunConfig:
    return load_config(RunConfig, "configs/demo.toml", [
        "--task.kind", "geometry3k", "--task.dataset", str(dataset), *BROKEN_LIMITS,
        "--trainer.seed", str(_seed_reading_every_row_once(KINDS)), "--trainer.steps", "3",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--rollout.filter_zero_variance", "false",
        "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4", "--checkpoint.every_steps", "2",
        "--eval.every_steps", "3", "--eval.prompts", str(len(KINDS)), "--log.dir", str(run_dir), *extra])


@pytest.mark.slow
def test_rl_skips_each_broken_row_once_and_resumes_without_listing_one_twice(broken, tmp_path):
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl
    from saccade.trainer.checkpoint.folder import latest_checkpoint

    cfg = _config(broken, tmp_path / "straight")
    assert train_rl(cfg, run_dir=cfg.run_dir, progress=False)["step"] == 3  # trained to the end
    listed = read_skipped(cfg.run_dir)
    assert sorted(r["reason"] for r in listed) == sorted(SKIP_REASONS)  # each reason once
    assert {r["id"] for r in listed} == {f"geometry3k-train-{i}" for i, k in enumerate(KINDS) if k != "good"}
    assert {r["reason"]: r["index"] for r in listed} == {k: i for i, k in enumerate(KINDS) if k != "good"}
    assert all(r["split"] == "train" and r["detail"] for r in listed)
    train = read_metrics(cfg.run_dir, phase="train")
    for reason in SKIP_REASONS:  # counted in the step that read it
        assert [r[f"skipped_{reason}"] for r in train] == [
            sum(x["reason"] == reason and x["step"] == r["step"] for x in listed) for r in train]
        assert sum(r[f"skipped_{reason}"] for r in train) == 1
    (evaluated,) = read_metrics(cfg.run_dir, phase="eval")
    broken_rows = len(KINDS) - 6
    assert evaluated["skipped"] == broken_rows  # the held-out split holds the same rows: 6 scored, the rest apart
    # 3 steps of 2 prompts: the 6 good rows and the broken ones, one epoch.
    assert json.loads((latest_checkpoint(cfg.run_dir) / "state.json").read_text())["data_position"] == len(KINDS)

    # Killed after step 2 (checkpointed) while step 3 was listing its skips, one line torn.
    cfg2 = _config(broken, tmp_path / "killed", "--eval.every_steps", "0")
    train_rl(cfg2, run_dir=cfg2.run_dir, progress=False, stop_after=2)
    later = [r for r in listed if r["step"] == 3]
    with open(cfg2.run_dir / SKIPPED_FILE, "ab") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in later) + b'{"step": 3, "posi')
    train_rl(cfg2, run_dir=cfg2.run_dir, progress=False, resume=True)
    assert (cfg2.run_dir / SKIPPED_FILE).read_text() == (cfg.run_dir / SKIPPED_FILE).read_text()
    resumed = read_metrics(cfg2.run_dir, phase="train")
    assert [{k: v for k, v in r.items() if k.startswith("skipped_")} for r in resumed] == [
        {k: v for k, v in r.items() if k.startswith("skipped_")} for r in train]


@pytest.mark.slow
def test_rl_stops_when_half_the_rows_are_broken(tmp_path):
    from saccade.loops.rl import train_rl

    kinds = ["good"] * 4 + ["bad_image"] * 3 + ["no_answer"]
    dataset = write_broken_geometry3k(tmp_path / "half", kinds, splits=("train",))
    # 128 prompts asked in one step: the stream reads past 200 rows before any is sampled.
    cfg = _config(dataset, tmp_path / "run", "--rollout.prompts_per_step", "128", "--eval.every_steps", "0")
    with pytest.raises(TooManySkippedRows, match=r"commonest reason is bad_image .*skipped\.jsonl"):
        train_rl(cfg, run_dir=cfg.run_dir, progress=False)
    listed = read_skipped(cfg.run_dir)
    assert len(listed) == 100 and {r["reason"] for r in listed} == {"bad_image", "no_answer"}


@pytest.mark.slow
def test_eval_scores_the_usable_rows_and_reports_the_skipped_apart(broken, tmp_path):
    from saccade.orchestrator.evaluation import format_eval, run_eval

    cfg = _config(broken, tmp_path / "run")
    result = run_eval(cfg)
    assert result["n"] == len(result["rows"]) == 6
    assert [r["id"] for r in result["rows"]] == [f"geometry3k-test-{i}" for i, k in enumerate(KINDS) if k == "good"]
    assert result["accuracy"] == pytest.approx(sum(r["correct"] for r in result["rows"]) / 6)
    assert result["skipped"] == {reason: 1 for reason in SKIP_REASONS}
    assert {r["reason"]: r["id"] for r in result["skipped_rows"]} == {
        k: f"geometry3k-test-{i}" for i, k in enumerate(KINDS) if k != "good"}
    shown = " ".join(format_eval(result).split())  # the table may wrap its title
    assert f"6 questions ({len(KINDS) - 6} rows skipped as broken, not scored)" in shown and "too_long 1" in shown

