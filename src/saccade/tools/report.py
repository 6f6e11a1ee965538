"""`saccade report RUN_DIR`: one self-contained HTML page about a run, readable offline.

The page holds, from the run folder:

* the curves of metrics.jsonl, the groups `saccade plot` draws (`saccade.tools.plot.plotted_groups`:
  reward, accuracy, lengths, KL, mismatch, step time, ...), as matplotlib SVGs;
* the evaluations: the RL loop's held-out greedy success (the "eval" records of metrics.jsonl,
  with `accuracy_blank` and `visual_gain` where the run measured them) and every
  `saccade eval --json` file found in the folder, per category;
* a gallery of samples.jsonl (`saccade.loops.sample_log`): per step, each prompt's images and text
  and its G completions coloured by reward, each with its reply's logprob and how much its
  images raise it (`image_logprob_gain`, `saccade.orchestrator.visual`), with a step slider (arrow keys
  move it);
* the resolved config.toml the run ran with.

Everything is inside the one file: CSS and a small script inline, images and curves as data
URLs, the samples as a JSON block the script renders. Nothing is fetched from the network.
A long run's gallery keeps `max_sample_steps` steps, evenly spread, the last always among them,
so the page stays a few MB.

Loaded as `report.html?selftest`, the page renders every gallery step once and writes what it
measured (each curve's and each image's naturalWidth) as JSON into `<pre id="selftest">`:
tests/tools/test_report.py reads it from a real headless browser's DOM.
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from saccade.metrics import RESERVED_KEYS, SAMPLES_FILE, read_metrics

__all__ = ["REPORT_FILE", "build_report", "report_command", "write_report"]

REPORT_FILE = "report.html"
CONFIG_FILE = "config.toml"


def curve_svgs(records: list[dict]) -> list[tuple[str, str]]:
    """(title, SVG text) for each group of metrics the run has, drawn as `saccade plot` draws them."""
    from matplotlib.figure import Figure

    from saccade.tools.plot import draw_group, plotted_groups

    series, present = plotted_groups(records)
    out = []
    for group, keys in present:
        fig = Figure(figsize=(5.6, 3.4), layout="constrained")
        draw_group(fig.add_subplot(), group, keys, series, compact=True)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        out.append((group.title, buffer.getvalue()))
    return out


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def spread(items: list, n: int) -> list:
    """At most n of items, evenly spaced, the first and the last among them."""
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[-1]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def table(header: list[str], rows: list[list[Any]]) -> str:
    """An HTML table; numbers shown with 4 significant digits, right-aligned."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f'<td class="num">{v:.4g}</td>'
        if isinstance(v, int) and not isinstance(v, bool):
            return f'<td class="num">{v}</td>'
        return f"<td>{html.escape('' if v is None else str(v))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def eval_section(records: list[dict], run_dir: Path) -> str:
    """The RL loop's eval records as one table over steps, then each `saccade eval --json` file
    of the folder (a JSON object with "accuracy" and "by_category"): figures and categories."""
    parts = []
    evals = [r for r in records if r.get("phase") == "eval"]
    if evals:
        keys = [k for k in dict.fromkeys(k for r in evals for k in r) if k not in RESERVED_KEYS]
        parts.append("<h3>During training (greedy, held-out split)</h3>")
        parts.append(table(["step", *keys], [[r["step"], *(r.get(k) for k in keys)] for r in evals]))
    for path in sorted(run_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or "accuracy" not in result or "by_category" not in result:
            continue
        parts.append(f"<h3>{html.escape(path.name)} (saccade eval)</h3>")
        rows = [["weights", str(result.get("weights", "?"))], ["questions", result.get("n")],
                ["greedy accuracy", result["accuracy"]]]
        if "visual_gain" in result:
            rows += [["greedy accuracy, every image blank", result["accuracy_blank"]],
                     ["visual gain", result["visual_gain"]]]
        rows += [[f"pass@{k}", v] for k, v in result.get("pass_at_k", {}).items()]
        parts.append(table(["", "value"], rows))
        for field, groups in result["by_category"].items():
            parts.append(table([field, "n", "accuracy"], [[value, g["n"], g["accuracy"]] for value, g in groups.items()]))
    return "\n".join(parts) or "<p>No evaluation in this run (eval.every_steps = 0, and no saccade eval --json file "\
        "in the folder).</p>"


def gallery_data(run_dir: Path, max_steps: int) -> dict[str, Any]:
    """samples.jsonl's records of at most `max_steps` steps, and each image they name as a data URL."""
    path = run_dir / SAMPLES_FILE
    records = read_metrics(path) if path.exists() else []
    by_step: dict[int, list[dict]] = {}
    for rec in records:  # a step written twice (a resume that was not truncated) keeps its last lines
        by_step.setdefault(rec["step"], [])
        if rec["prompt_id"] in {r["prompt_id"] for r in by_step[rec["step"]]}:
            by_step[rec["step"]] = []
        by_step[rec["step"]].append(rec)
    steps = spread(sorted(by_step), max_steps)
    images: dict[str, str] = {}
    for step in steps:
        for rec in by_step[step]:
            paths = rec["prompt"]["images"] + [p for c in rec["completions"] for r in c.get("replies", [])
                                               for p in r["images"]]
            for rel in paths:
                if rel not in images and (run_dir / rel).is_file():
                    images[rel] = data_url((run_dir / rel).read_bytes(), "image/png")
    return {"steps": steps, "records": {str(s): by_step[s] for s in steps}, "images": images}


def summary(records: list[dict], run_dir: Path) -> str:
    train = [r for r in records if r.get("phase", "train") == "train"]
    evals = [r for r in records if r.get("phase") == "eval" and "accuracy" in r]
    items = [f"{len(train)} steps logged"]
    if train:
        last = train[-1]
        items.append(f"last step {last['step']}")
        for key, label in (("reward_mean", "reward"), ("accuracy", "accuracy"), ("step_s", "s/step")):
            if isinstance(last.get(key), (int, float)):
                items.append(f"{label} {last[key]:.3g}")
        items.append(f"{last.get('elapsed_s', 0) / 60:.1f} min")
    if evals:
        last_eval = evals[-1]
        gain = last_eval.get("visual_gain")
        also = f" (visual gain {gain:+.3g})" if isinstance(gain, (int, float)) else ""
        items.append(f"eval accuracy {last_eval['accuracy']:.3g}{also} at step {last_eval['step']}")
    return " · ".join(html.escape(i) for i in items)


def build_report(run_dir: str | Path, *, max_sample_steps: int = 50) -> str:
    """The report page of the run in `run_dir`, as HTML text. Raises ValueError when the folder
    has no metrics.jsonl records."""
    from saccade.tools.plot import run_records

    run_dir = Path(run_dir)
    records = run_records(run_dir)
    curves = "\n".join(
        f'<figure><img class="curve" alt="{html.escape(title)}" src="{data_url(svg.encode(), "image/svg+xml")}">'
        f"</figure>" for title, svg in curve_svgs(records)) or "<p>No metric of a plotted group.</p>"
    config = run_dir / CONFIG_FILE
    config_text = html.escape(config.read_text()) if config.is_file() else f"(no {CONFIG_FILE} in the run folder)"
    gallery = gallery_data(run_dir, max_sample_steps)
    # A JSON block is data, not script: only "</" could end it early.
    gallery_json = json.dumps(gallery, allow_nan=False).replace("</", "<\\/")
    name = html.escape(run_dir.resolve().name)
    return PAGE.format(
        name=name, summary=summary(records, run_dir), written=time.strftime("%Y-%m-%d %H:%M"), curves=curves,
        evals=eval_section(records, run_dir), config=config_text, gallery_json=gallery_json,
        samples_note="" if gallery["steps"] else f"<p>No {SAMPLES_FILE} in this run (log.samples_every = 0, or an "
        "SFT run).</p>",
        css=CSS, script=SCRIPT,
    )


def write_report(run_dir: str | Path, out: str | Path | None = None, *, max_sample_steps: int = 50) -> Path:
    """Write the page to `out` (default `run_dir/report.html`) and return its path."""
    page = build_report(run_dir, max_sample_steps=max_sample_steps)
    out = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def report_command(run_dir: str, out: str | None = None, *, max_sample_steps: int = 50) -> int:
    """`saccade report RUN_DIR`: write the page, print its path; 1 with a message if no metrics."""
    try:
        path = write_report(Path(run_dir), out, max_sample_steps=max_sample_steps)
    except (ValueError, ImportError) as e:
        print(f"saccade report: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1400px; padding: 0 16px 40px; color: #222; }
header { border-bottom: 1px solid #ddd; margin-bottom: 8px; }
h1 { margin: 16px 0 4px; } h2 { margin-top: 28px; border-bottom: 1px solid #eee; } nav a { margin-right: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 8px; }
figure { margin: 0; } .curve { width: 100%; height: auto; border: 1px solid #eee; }
table { border-collapse: collapse; margin: 6px 0 14px; } th, td { border: 1px solid #ddd; padding: 2px 8px; }
th { background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre.config { background: #f8f8f8; padding: 10px; overflow: auto; max-height: 480px; }
.controls { position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 1; }
.controls input[type=range] { width: 50%; vertical-align: middle; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px; margin: 8px 0; display: flex; gap: 12px; }
.card .prompt { flex: 0 0 300px; } .card .prompt img { width: 192px; height: auto; image-rendering: pixelated; border: 1px solid #ccc; }
.card .answers { flex: 1; min-width: 0; }
.completion { border-radius: 4px; padding: 3px 8px; margin: 3px 0; white-space: pre-wrap; word-break: break-word; }
.completion .score { font: 12px monospace; color: #333; margin-right: 8px; } .completion .gain { color: #555; }
.reply { color: #555; font-style: italic; } .reply img { max-height: 96px; vertical-align: middle; margin: 2px; }
.muted { color: #777; }
"""

SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('samples-data').textContent);
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
const num = (v, sign) => v === null || v === undefined ? 'nan' : (sign && v >= 0 ? '+' : '') + v.toFixed(2);
// One colour scale for the whole run, so that a colour means the same reward at every step.
const rewards = Object.values(DATA.records).flat().flatMap(r => r.completions.map(c => c.reward)).filter(v => v !== null);
const lo = Math.min(...rewards), hi = Math.max(...rewards);
const colour = r => {
  const t = r === null ? 0.5 : hi > lo ? (r - lo) / (hi - lo) : 0.5;
  return `hsl(${Math.round(120 * t)}, 70%, 88%)`;  // red (lowest) to green (highest)
};
const img = path => DATA.images[path] ? `<img src="${DATA.images[path]}" alt="${esc(path)}">`
                                      : `<span class="muted">[missing ${esc(path)}]</span>`;
// How much more likely its images make the reply (samples.jsonl's image_logprob_gain), the
// reply's logprob with and without them in the tooltip; absent in older runs' records.
const gain = c => c.image_logprob_gain === undefined ? '' :
  ` <span class="gain" title="reply logprob ${num(c.reply_logprob)}, with blank images ${num(c.reply_logprob_blank)}">` +
  `logp=${num(c.reply_logprob)} img=${num(c.image_logprob_gain, true)}</span>`;
function card(rec) {
  const answers = rec.completions.map(c => {
    const turns = c.texts.map((t, i) => esc(t) + (c.replies[i] ? `<div class="reply">${c.replies[i].images.map(img).join('')} ${esc(c.replies[i].text)}</div>` : ''));
    return `<div class="completion" style="background:${colour(c.reward)}"><span class="score">r=${num(c.reward)} A=${num(c.advantage, true)} ${esc(c.finish_reasons.join(','))}${gain(c)}</span>${turns.join('<br>')}</div>`;
  }).join('');
  const answer = rec.answer !== undefined ? `<div><b>answer:</b> ${esc(rec.answer)}</div>` : '';
  return `<div class="card"><div class="prompt">${rec.prompt.images.map(img).join(' ')}<div class="muted">${esc(rec.prompt_id)}</div><div>${esc(rec.prompt.text)}</div>${answer}</div><div class="answers">${answers}</div></div>`;
}
const slider = document.getElementById('step-slider');
function show(i) {
  slider.value = i;
  const step = DATA.steps[i];
  document.getElementById('step-label').textContent = `step ${step} (${+i + 1} of ${DATA.steps.length} logged)`;
  document.getElementById('gallery').innerHTML = DATA.records[String(step)].map(card).join('');
}
if (DATA.steps.length) {
  slider.max = DATA.steps.length - 1;
  slider.oninput = () => show(slider.value);
  document.addEventListener('keydown', e => {
    if (e.key === 'ArrowLeft' && slider.value > 0) show(+slider.value - 1);
    if (e.key === 'ArrowRight' && +slider.value < DATA.steps.length - 1) show(+slider.value + 1);
  });
  show(DATA.steps.length - 1);
} else {
  document.querySelector('.controls').hidden = true;
}
async function selftest() {  // report.html?selftest: what a browser rendered, for the tests
  const decoded = async imgs => { await Promise.all(imgs.map(im => im.decode().catch(() => null))); return imgs.map(im => im.naturalWidth); };
  const out = {curves: await decoded([...document.querySelectorAll('img.curve')]),
               curve_titles: [...document.querySelectorAll('img.curve')].map(im => im.alt), steps: []};
  for (let i = 0; i < DATA.steps.length; i++) {
    show(i);
    out.steps.push({step: DATA.steps[i], images: await decoded([...document.querySelectorAll('#gallery img')]),
                    completions: document.querySelectorAll('#gallery .completion').length});
  }
  if (DATA.steps.length) show(DATA.steps.length - 1);
  const el = document.getElementById('selftest');
  el.textContent = JSON.stringify(out);
  el.hidden = false;
}
if (new URLSearchParams(location.search).has('selftest')) selftest();
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>saccade report: {name}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{css}</style></head>
<body>
<header><h1>saccade run {name}</h1><p>{summary}</p>
<nav><a href="#curves">curves</a><a href="#eval">evaluation</a><a href="#samples">samples</a><a href="#config">config</a>
<span class="muted">written {written}</span></nav></header>
<section id="curves"><h2>Curves</h2><div class="grid">{curves}</div></section>
<section id="eval"><h2>Evaluation</h2>{evals}</section>
<section id="samples"><h2>Samples</h2>{samples_note}
<div class="controls"><input type="range" id="step-slider" min="0" max="0" value="0"> <span id="step-label"></span>
<span class="muted">(← → move; completions coloured by reward, red lowest to green highest in the run)</span></div>
<div id="gallery"></div></section>
<section id="config"><h2>Config (config.toml, as resolved)</h2><pre class="config">{config}</pre></section>
<pre id="selftest" hidden></pre>
<script type="application/json" id="samples-data">{gallery_json}</script>
<script>{script}</script>
</body></html>
"""
