"""RolloutSource: how far ahead rollouts are sampled, and what the trainer gets when sampling fails.

No sleeps: where a test needs the sampling thread to have got somewhere, it waits on a
condition, so a loaded machine makes it slower, never wrong."""

from __future__ import annotations

import threading

import pytest

from saccade.data.rows import StepRows
from saccade.orchestrator.rollout import RolloutBatch, StepRollouts
from saccade.orchestrator.source import RolloutSource


WAIT_S = 30  # a condition not met in this long is a failure, not a slow machine


def rollouts(step: int, groups: list, pins=None) -> StepRollouts:
    """A step's rollouts as the source sees them: `groups` stand for the sampled groups."""
    return StepRollouts(step, groups, pins, 0.01, StepRows([], [], 0, []), [], RolloutBatch([], {}))


class Recorder:
    """A sampler that records, for each step, how many steps had trained when it began."""

    def __init__(self, fail_at: int | None = None):
        self.trained = 0
        self.began: dict[int, int] = {}
        self.threads: set[str] = set()
        self.fail_at = fail_at
        self.changed = threading.Condition()

    def __call__(self, step: int) -> StepRollouts:
        with self.changed:
            self.began[step] = self.trained
            self.changed.notify_all()
        self.threads.add(threading.current_thread().name)
        if step == self.fail_at:
            raise ConnectionError("no server")
        return rollouts(step, [f"groups of {step}"])

    def wait_began(self, step: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: step in self.began, timeout=WAIT_S)


def run(source: RolloutSource, recorder: Recorder, steps: range, *, ahead: bool = False) -> list:
    """The trainer's side. `ahead`: each train step lasts until the next step's sampling has
    begun (as a real step outlasts the start of sampling); without sampling ahead it never would."""
    got = []
    for step in steps:
        item, waited, depth = source.get(step)
        got.append((item.groups[0], depth))
        if ahead and step + 1 < steps.stop:  # the train step
            assert recorder.wait_began(step + 1), f"step {step + 1} did not begin while step {step} trained"
        recorder.trained = step + 1
        source.trained(step)
    return got


@pytest.mark.parametrize("level", [0, 1, 2])
def test_step_s_is_sampled_once_steps_before_s_minus_level_have_trained(level):
    recorder = Recorder()
    recorder.trained = 3  # a resumed run: steps 0..2 trained before
    with RolloutSource(recorder, first_step=3, end=9, max_async_level=level) as source:
        got = run(source, recorder, range(3, 9), ahead=level > 0)
    assert [g for g, _ in got] == [f"groups of {s}" for s in range(3, 9)]
    for step, trained in recorder.began.items():
        assert trained >= step - level, (step, trained)  # never staler than the level
    if level == 0:
        assert recorder.threads == {threading.current_thread().name}
    else:
        assert recorder.threads == {"saccade-rollouts"}
        # Sampling ahead did happen (run() waited for it): every step after the first began
        # before the one just before it had trained.
        assert all(trained < step for step, trained in recorder.began.items() if step > 3)
        assert max(d for _, d in got) <= level


def test_an_error_while_sampling_ahead_reaches_the_trainer_at_that_step():
    recorder = Recorder(fail_at=2)
    with RolloutSource(recorder, first_step=0, end=5, max_async_level=1) as source:
        run(source, recorder, range(2))
        with pytest.raises(ConnectionError, match="no server"):
            source.get(2)


def test_close_stops_sampling_ahead_and_releases_queued_pins():
    released, sampled = [], []

    class Pins:
        def release(self):
            released.append(True)

    def sample(step):
        sampled.append(step)
        return rollouts(step, [], Pins())

    source = RolloutSource(sample, first_step=0, end=100, max_async_level=2)
    with source._changed:  # steps 0..2 sampled and queued; step 3 waits for step 0 to train
        assert source._changed.wait_for(lambda: len(source._ready) == 3, timeout=WAIT_S)
    source.close()
    assert sampled == [0, 1, 2] and len(released) == 3 and not source._thread.is_alive()


def pushed_versions(level: int, *, first_step: int = 0, end: int = 10, on_policy=lambda step: False) -> list:
    """(step, the version on the servers when it began sampling) for a trainer that trains in no
    time, from `first_step` on (a resume: the weights of `first_step` pushed at its start)."""
    pushed, recorder, versions = [], Recorder(), {"now": first_step}

    def sample(step):
        pushed.append((step, versions["now"]))
        return recorder(step)

    with RolloutSource(sample, first_step=first_step, end=end, max_async_level=level,
                       on_policy=on_policy) as source:
        for step in range(first_step, end):
            source.get(step)
            source.wait_to_push(step + 1)
            versions["now"] = step + 1
            source.trained(step)
    return pushed


@pytest.mark.parametrize("level", [1, 2])
def test_a_push_waits_until_the_steps_due_to_sample_older_weights_have_sampled(level):
    """Which weights a step samples is the schedule's choice, not the machine's speed: step s
    samples the newest weights pushed by step s - level, even when the trainer is fast."""
    assert pushed_versions(level, end=8) == [(s, max(0, s - level)) for s in range(8)]


@pytest.mark.parametrize("level", [1, 2])
def test_the_steps_after_a_checkpoint_sample_its_weights_so_a_resume_samples_as_the_run_never_stopped(level):
    """A resume from the checkpoint after step 4 has the weights of step 4 only: the run never
    stopped samples step 4 (and the steps after it, while they are within the level) from those
    same weights, the other steps as before (lag `level`)."""
    after_checkpoint = lambda step: step % 4 == 0  # noqa: E731 - checkpoint.every_steps = 4
    straight = pushed_versions(level, on_policy=after_checkpoint)
    last_checkpoint = lambda s: s - s % 4  # noqa: E731
    assert straight == [(s, max(s - level, last_checkpoint(s))) for s in range(10)]
    assert pushed_versions(level, first_step=4, on_policy=after_checkpoint) == straight[4:]
    # Without it, the resumed run's first steps sample newer weights than the run never stopped.
    assert pushed_versions(level, first_step=4)[:level] != pushed_versions(level)[4:4 + level]


def test_a_push_does_not_wait_for_a_sampler_that_failed():
    recorder = Recorder(fail_at=1)
    with RolloutSource(recorder, first_step=0, end=5, max_async_level=2) as source:
        source.get(0)
        source.wait_to_push(1)  # steps 1 and 2 were due first: step 1 failed, nothing more samples
        with pytest.raises(ConnectionError):
            source.get(1)
