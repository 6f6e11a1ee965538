"""`saccade report` on a real short RL run, opened in a real headless browser (Debian's
`chromium`): the page loads offline, every curve and every gallery image is rendered
(naturalWidth > 0, measured by the page itself under ?selftest), every logged step's
completions are shown, the eval tables are there; a screenshot is saved."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from PIL import Image

from saccade.cli import main
from saccade.orchestrator.evaluation import by_category
from saccade.metrics import read_metrics
from saccade.tools.report import build_report

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no `chromium` on PATH: apt-get install -y chromium (the report test drives a real "
    "headless browser)")


def chromium(*args: str, profile) -> str:
    """Headless chromium's stdout. --virtual-time-budget lets the page's scripts (and the image
    decodes they wait for) finish before the DOM is dumped or the screenshot taken."""
    done = subprocess.run(
        [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", f"--user-data-dir={profile}",
         "--virtual-time-budget=10000", *args], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


@pytest.fixture(scope="module")
def report(short_rl_run, tmp_path_factory):
    """The run folder (a copy, with a `saccade eval --json` file added) and its report's path."""
    cfg, _ = short_rl_run
    run_dir = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(cfg.run_dir, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    rows = [{"metadata": {"kind": "color"}, "correct": c} for c in (1.0, 0.0, 1.0, 1.0)]
    (run_dir / "eval.json").write_text(json.dumps({
        "weights": "checkpoints/step_000004", "n": 4, "accuracy": 0.75, "task": "shapes",
        "by_category": by_category(rows), "pass_at_k": {"1": 0.75}}))
    out = run_dir / "report.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    return run_dir, out


@pytest.mark.slow
def test_the_page_is_self_contained(report):
    _, out = report
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page must fetch nothing"
    assert "<link" not in page and "<script src" not in page
    assert page.count('class="curve"') >= 8 and "data:image/svg+xml;base64," in page
    assert "data:image/png;base64," in page  # the gallery's thumbnails
    for text in ("[rollout]", "group_size = 4", "During training (greedy, held-out split)", "eval.json (saccade eval)",
                 "<td>color</td>", "<th>accuracy_blank</th>", "<th>visual_gain</th>", "(visual gain "):
        assert text in page


@pytest.mark.slow
def test_every_eval_of_the_run_logs_its_visual_gain(short_rl_run):
    """eval.visual_gain (on by default): the eval records hold accuracy_blank and visual_gain, and
    the step's train record eval_accuracy_blank and visual_gain beside eval_accuracy."""
    cfg, _ = short_rl_run
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    evals = [r for r in records if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for ev in evals:
        assert 0.0 <= ev["accuracy_blank"] <= 1.0 and ev["visual_gain"] == ev["accuracy"] - ev["accuracy_blank"]
        (train,) = [r for r in records if r["phase"] == "train" and r["step"] == ev["step"]]
        assert (train["eval_accuracy"], train["eval_accuracy_blank"], train["visual_gain"]) == (
            ev["accuracy"], ev["accuracy_blank"], ev["visual_gain"])
    assert all("visual_gain" not in r for r in records if r["step"] % 2)  # only where the run evaluated


@pytest.mark.slow
@needs_chromium
def test_a_browser_renders_the_curves_and_every_gallery_step(report, tmp_path):
    _, out = report
    dom = chromium("--dump-dom", out.as_uri() + "?selftest", profile=tmp_path / "profile")
    found = re.search(r'<pre id="selftest">(.*?)</pre>', dom, re.S)
    assert found, "the page's self-test did not run (no JSON in #selftest)"
    measured = json.loads(found.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    assert {"Reward", "Accuracy", "Completion length", "Train / inference mismatch", "Step time"} <= set(
        measured["curve_titles"])
    assert measured["curves"] and all(w > 0 for w in measured["curves"])
    assert [s["step"] for s in measured["steps"]] == [1, 2, 3, 4]
    for step in measured["steps"]:
        assert step["images"] == [64, 64]  # each prompt's thumbnail, decoded at its size
        assert step["completions"] == 2 * 4  # 2 prompts x G = 4
    # Each completion shows its reply's logprob and what its image adds (the last step's, as left shown).
    assert len(re.findall(r'class="gain" title="reply logprob -\d+\.\d\d, with blank images -\d+\.\d\d">'
                          r'logp=-\d+\.\d\d img=[+-]\d+\.\d\d<', dom)) == 2 * 4


@pytest.mark.slow
@needs_chromium
def test_a_screenshot_of_the_report(report, tmp_path):
    _, out = report
    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2400", out.as_uri(), profile=tmp_path / "profile")
    with Image.open(shot) as im:
        assert im.size == (1280, 2400)
        colours = im.convert("RGB").resize((64, 120)).getcolors(64 * 120)
    assert len(colours) > 50, "the screenshot is blank"


def test_a_folder_without_metrics_is_refused(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        build_report(tmp_path)
