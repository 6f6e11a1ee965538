"""The serve helpers that need no running server: exposure, defaults, output layout, weight checks."""

from __future__ import annotations

import pytest
import torch

from saccade.config import is_loopback
from saccade.serving.flags import DEFAULT_FLAGS, NO_REMOTE_MEDIA, api_keys, check_dev_mode, check_exposure, with_defaults
from saccade.serving.server import split_features
from saccade.serving.validation import RequestError
from saccade.serving.weights import check_weights_folder


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("", False), ("10.1.2.3", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_listening_beyond_this_machine_needs_an_api_key_and_loopback_without_one_is_warned_about():
    assert "no API key" in check_exposure("127.0.0.1", ())
    assert check_exposure("127.0.0.1", ("k",)) is None
    assert check_exposure("0.0.0.0", ("secret",)) is None
    with pytest.raises(SystemExit, match="--api-key"):
        check_exposure("0.0.0.0", ())


def test_every_api_key_given_is_kept_else_the_environments():
    assert api_keys(["a", "b"], {"VLLM_API_KEY": "env"}) == ("a", "b")
    assert api_keys(None, {"VLLM_API_KEY": "env"}) == api_keys([], {"VLLM_API_KEY": "env"}) == ("env",)
    assert api_keys(None, {}) == () and api_keys("one", {}) == ("one",)


def test_vllms_dev_mode_is_refused_and_remote_media_is_off_by_default():
    check_dev_mode({}) or check_dev_mode({"VLLM_SERVER_DEV_MODE": "0"})
    with pytest.raises(SystemExit, match="collective_rpc"):
        check_dev_mode({"VLLM_SERVER_DEV_MODE": "1"})
    args = with_defaults([])
    assert args[args.index("--allowed-media-domains") + 1] == NO_REMOTE_MEDIA
    assert with_defaults(["--allowed-media-domains", "example.com"]).count("--allowed-media-domains") == 1


def test_defaults_fill_only_the_flags_the_user_did_not_give():
    args = with_defaults(["--dtype", "float32", "--host=0.0.0.0"])
    assert args.count("--host") == 0 and "--host=0.0.0.0" in args
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--worker-extension-cls") + 1] == DEFAULT_FLAGS["--worker-extension-cls"]


def test_the_lm_head_is_float32_unless_the_user_says_otherwise():
    import json

    from saccade.inference.server_client import head_dtype_problem

    def overrides(args):
        return json.loads(args[args.index("--hf-overrides") + 1])

    assert overrides(with_defaults(["--dtype", "bfloat16"])) == {"head_dtype": "float32"}
    # merged into the user's own overrides, in either spelling; a head_dtype they chose stays
    mine = with_defaults(["--hf-overrides", '{"rope_theta": 1}', "--dtype", "bfloat16"])
    assert overrides(mine) == {"rope_theta": 1, "head_dtype": "float32"} and mine.count("--hf-overrides") == 1
    assert overrides(with_defaults(['--hf-overrides={"head_dtype": "model"}'])) == {"head_dtype": "model"}
    with pytest.raises(SystemExit, match="JSON object"):
        with_defaults(["--hf-overrides", "[1]"])
    # The trainer's side: a bf16 server that rounds its logits is refused, with the fix.
    assert head_dtype_problem({"dtype": "bfloat16", "head_dtype": "float32"}) is None
    assert head_dtype_problem({"dtype": "float32", "head_dtype": "float32"}) is None
    assert head_dtype_problem({}) is None  # a server too old to say
    assert "head_dtype" in head_dtype_problem({"dtype": "bfloat16", "head_dtype": "bfloat16"})


def test_split_features_cuts_vllm_layout_into_main_and_deepstack():
    grid = [[1, 4, 4], [1, 2, 4]]  # 4 and 2 merged tokens
    hidden, levels = 3, 2
    features = torch.arange(6 * hidden * (1 + levels), dtype=torch.float32).view(6, hidden * (1 + levels))
    out = split_features(features, grid, merge=2, levels=levels)
    assert out["image_grid_thw"].tolist() == grid
    assert torch.equal(out["embeds.0"], features[:4, :hidden])
    assert torch.equal(out["deepstack.0"][1], features[:4, 2 * hidden:])
    assert out["embeds.1"].shape == (2, hidden) and out["deepstack.1"].shape == (levels, 2, hidden)
    with pytest.raises(RuntimeError, match="rows"):
        split_features(features[:5], grid, merge=2, levels=levels)


def test_weights_folder_checks_name_the_problem(tmp_path):
    from safetensors.torch import save_file

    reference = {"a.weight": [2, 3], "b.weight": [4]}
    with pytest.raises(RequestError, match="does not exist"):
        check_weights_folder(str(tmp_path / "nope"), reference)
    with pytest.raises(RequestError, match="no \\*.safetensors"):
        check_weights_folder(str(tmp_path), reference)
    save_file({"a.weight": torch.zeros(3, 2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(RequestError, match="wrong shape"):
        check_weights_folder(str(tmp_path), reference)
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "m.safetensors"))
    assert check_weights_folder(str(tmp_path), reference) == 1


@pytest.mark.slow
def test_serve_help_and_the_exposure_refusal_from_the_command_line(tiny_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "saccade.cli", "serve", *args], capture_output=True, text=True,
                              timeout=300)

    helped = run("--help")
    assert helped.returncode == 0 and "/encode_images" in helped.stdout and "usage: saccade serve MODEL" in helped.stdout
    assert "--weights-root DIR" in helped.stdout
    pytest.importorskip("vllm")
    refused = run(str(tiny_path), "--host", "0.0.0.0")
    assert refused.returncode != 0 and "--api-key" in refused.stderr


def test_a_cpu_server_takes_a_quarter_of_the_free_memory_for_its_kv_cache_within_1_to_4_gib():
    from saccade.serving.flags import choose_cpu_kv_cache, cpu_kv_cache_gib

    GiB = 2**30
    assert [cpu_kv_cache_gib(g * GiB) for g in (0, 2, 6, 9, 14, 100)] == [1, 1, 1, 2, 3, 4]
    assert choose_cpu_kv_cache({"VLLM_CPU_KVCACHE_SPACE": "7"}) is None  # the user's choice stands
    env: dict[str, str] = {}
    line = choose_cpu_kv_cache(env)
    import torch

    if torch.cuda.is_available():  # a GPU server's KV cache is vLLM's --gpu-memory-utilization
        assert line is None and not env
    else:
        assert 1 <= int(env["VLLM_CPU_KVCACHE_SPACE"]) <= 4 and "VLLM_CPU_KVCACHE_SPACE" in line


def test_saccade_options_are_taken_out_before_vllm_parses_the_rest():
    from saccade.serving.flags import pop_option

    args = ["--dtype", "float32", "--weights-root", "/runs", "--max-body-mb=2", "--port", "8000"]
    assert pop_option(args, "--weights-root") == "/runs"
    assert pop_option(args, "--max-body-mb") == "2"
    assert pop_option(args, "--weights-root") is None
    assert args == ["--dtype", "float32", "--port", "8000"]
    with pytest.raises(SystemExit, match="--weights-root needs a value"):
        pop_option(["--weights-root"], "--weights-root")


def test_resize_bounds_follow_vllms_order_folder_then_size_then_pixels_scoped_last():
    from saccade.serving.state import resize_bounds

    folder = {"shortest_edge": 65536, "longest_edge": 16777216}
    assert resize_bounds(folder, None) == (65536, 16777216)
    assert resize_bounds(folder, {"size": {"longest_edge": 802816}}) == (65536, 802816)  # what saccade launch passes
    assert resize_bounds(folder, {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "max_pixels": 8192}) \
        == (1024, 8192)
    assert resize_bounds(folder, {"max_pixels": 8192, "images_kwargs": {"max_pixels": 4096}}) == (65536, 4096)
