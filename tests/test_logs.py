"""saccade.logs: the library's events reach the person running it, once, from the rank they concern."""

from __future__ import annotations

import logging
import math
import pytest
import torch

from saccade.logs import ROOT, StderrHandler, configure

@pytest.fixture()
def configured():
    """`configure` as the command line calls it, undone afterwards (it is once per process)."""
    logger = logging.getLogger(ROOT)
    handlers, level = list(logger.handlers), logger.level
    logger.handlers[:] = [h for h in handlers if not isinstance(h, StderrHandler)]  # an earlier test's `saccade ...`
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_configure_sends_info_and_up_to_stderr_once(configured, capsys):
    first = configure(rank=0)
    assert configure(rank=0) is first  # a second call adds nothing
    logging.getLogger("saccade.inference.server_client").info("server %s is back in", "http://a")
    logging.getLogger("saccade.trainer.step").debug("not shown")
    logging.getLogger("elsewhere").warning("not ours")
    err = capsys.readouterr().err  # sys.stderr as it is now: capsys swapped it after configure
    assert "saccade: server http://a is back in\n" in err
    assert "not shown" not in err and "saccade: not ours" not in err


def test_ranks_other_than_0_name_themselves(configured, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    configure()
    logging.getLogger("saccade.stopping").warning("SIGTERM: stopping after this step")
    assert "saccade[rank 3]: SIGTERM: stopping after this step\n" in capsys.readouterr().err


def test_the_handler_writes_where_stderr_is_when_it_writes(capsys):
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    record = logging.LogRecord("saccade.x", logging.WARNING, __file__, 1, "a line", None, None)
    handler.emit(record)
    assert capsys.readouterr().err == "a line\n"


def test_a_skipped_step_is_logged_as_a_warning(caplog):
    from saccade.trainer.step import build_optimizer, optimizer_step

    model = torch.nn.Linear(3, 1)
    optimizer, scheduler = build_optimizer(model, lr=0.1, weight_decay=0.0, schedule=lambda k: 1.0)

    def loss(k, x):
        return model(x).sum() * float("nan"), {}

    with caplog.at_level(logging.WARNING, logger=ROOT):
        outcome = optimizer_step(optimizer, scheduler, [torch.ones(2, 3)], loss, device=torch.device("cpu"),
                                 grad_clip=1.0)
    assert not outcome.applied and math.isnan(outcome.sums["loss"])
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("saccade.trainer.step", "WARNING", "step skipped: non-finite loss; the weights were not changed")]


def test_the_command_line_configures_it(configured, capsys, tmp_path):
    """Any `saccade` command: from then on the library's INFO lines show on stderr."""
    from saccade.cli import main

    assert main(["plot", str(tmp_path / "no-run")]) != 0  # the command's own error
    logging.getLogger("saccade.inference.server_client").info("server http://a is back in")
    assert "saccade: server http://a is back in\n" in capsys.readouterr().err
