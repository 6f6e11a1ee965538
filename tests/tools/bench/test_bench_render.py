import json

from saccade.tools.bench.render import format_render_report, run_render_bench
from saccade.cli import main
from saccade.config.bench import RenderBenchConfig


def test_render_bench_measures_cold_and_cached():
    result = run_render_bench(RenderBenchConfig(size=32, renders=4, rooms=2, device="cpu"))
    assert result["cold_renders_per_s"] > 0 and result["cached_renders_per_s"] > 0
    assert (result["cache_hits"], result["cache_misses"]) == (4, 4)
    assert "renders/s" in format_render_report(result)


def test_saccade_bench_render_writes_json(tmp_path):
    out = tmp_path / "render.json"
    assert main(["bench", "render", "--size", "32", "--renders", "2", "--rooms", "1", "--device", "cpu",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["size"] == 32
