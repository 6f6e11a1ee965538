"""RolloutSource: how far ahead rollouts are sampled, and what the trainer gets when sampling fails."""

from __future__ import annotations

import threading
import time

import pytest

from saccade.orchestrator.source import RolloutSource, StepRollouts


class Recorder:
    """A sampler that records, for each step, how many steps had trained when it began."""

    def __init__(self, fail_at: int | None = None):
        self.trained = 0
        self.began: dict[int, int] = {}
        self.threads: set[str] = set()
        self.fail_at = fail_at

    def __call__(self, step: int) -> StepRollouts:
        self.began[step] = self.trained
        self.threads.add(threading.current_thread().name)
        if step == self.fail_at:
            raise ConnectionError("no server")
        time.sleep(0.01)
        return StepRollouts(step, [f"groups of {step}"], None, 0.01)


def run(source: RolloutSource, recorder: Recorder, steps: range, train_s: float = 0.02) -> list:
    got = []
    for step in steps:
        item, waited, depth = source.get(step)
        got.append((item.groups[0], depth))
        time.sleep(train_s)  # the train step
        recorder.trained = step + 1
        source.trained(step)
    return got


@pytest.mark.parametrize("level", [0, 1, 2])
def test_step_s_is_sampled_once_steps_before_s_minus_level_have_trained(level):
    recorder = Recorder()
    recorder.trained = 3  # a resumed run: steps 0..2 trained before
    with RolloutSource(recorder, first_step=3, end=9, max_async_level=level) as source:
        got = run(source, recorder, range(3, 9))
    assert [g for g, _ in got] == [f"groups of {s}" for s in range(3, 9)]
    for step, trained in recorder.began.items():
        assert trained >= step - level, (step, trained)  # never staler than the level
    if level == 0:
        assert recorder.threads == {threading.current_thread().name}
    else:
        assert recorder.threads == {"saccade-rollouts"}
        # Sampling ahead did happen: some step began before the one just before it had trained.
        assert any(trained < step for step, trained in recorder.began.items())
        assert max(d for _, d in got) <= level


def test_an_error_while_sampling_ahead_reaches_the_trainer_at_that_step():
    recorder = Recorder(fail_at=2)
    with RolloutSource(recorder, first_step=0, end=5, max_async_level=1) as source:
        run(source, recorder, range(2))
        with pytest.raises(ConnectionError, match="no server"):
            source.get(2)


def test_close_stops_sampling_ahead_and_releases_queued_pins():
    released = []

    class Pins:
        def release(self):
            released.append(True)

    def sample(step):
        return StepRollouts(step, [], Pins(), 0.0)

    source = RolloutSource(sample, first_step=0, end=100, max_async_level=2)
    time.sleep(0.2)  # steps 0..2 sampled and queued; step 3 waits for step 0 to train
    source.close()
    assert len(released) == 3 and not source._thread.is_alive()
