"""Faults a push check must catch, in front of a real `saccade serve` (tests/serving/test_vllm_push_check.py).

`FaultyProxy` is an HTTP proxy on a port of its own that forwards everything to the server behind it,
except what its `mode` changes:
- "pass": nothing (the control);
- "ignore": a server that ignores pushes. POST /update_weights is answered 200 and never forwarded,
  and every reply carries the version last pushed (its `x-saccade-policy-version` header and
  /saccade/info's `policy_version`), as a server whose load did nothing but reports success would;
- "empty_adapter": an adapter push that loads nothing. The pushed LoRA adapter's folder is copied with
  every `lora_B` tensor zeroed and the server loads the copy: it samples the base model under the
  adapter's name and version (what vLLM #49354 reports: an adapter whose modules match none of the
  model's changes nothing).
`stop()` closes its port (connections refused: a server gone), `start()` opens it again.

`shifted_positions_env` is the environment of a `saccade serve` whose vLLM computes the M-RoPE
positions of image tokens one patch off (h and w + `SHIFT`): image positions corrupted on the
engine's side only (slime #2336). vLLM's engine and worker processes are spawned, fresh interpreters
that a patch made in the server's own process does not reach; so the patch is a vLLM general plugin
(`vllm.general_plugins`, which vLLM loads in every one of its processes), declared by a dist-info
folder on the server's PYTHONPATH.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from saccade.serving.wire import INFO, UPDATE_WEIGHTS, VERSION_HEADER

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


def empty_adapter(folder: str) -> str:
    """A copy of the adapter folder beside it whose lora_B tensors are all zero: it changes nothing."""
    from safetensors.torch import load_file, save_file

    out = Path(folder).with_name(Path(folder).name + "-empty")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    weights = out / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: (v.zero_() if "lora_B" in k else v) for k, v in tensors.items()}, weights)
    return str(out)


class FaultyProxy:
    def __init__(self, backend: str, mode: str = "pass", port: int = 0):
        self.backend, self.mode, self.port = backend.rstrip("/"), mode, port
        self.version: int | None = None  # "ignore": the version it acknowledged last
        self.pushes: list[dict] = []  # every /update_weights body it was sent
        self.http = httpx.Client(timeout=600)
        self.server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, mode: str | None = None) -> FaultyProxy:
        self.mode = mode or self.mode
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.forward(self, "GET", b"")

            def do_POST(self):
                proxy.forward(self, "POST", self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def forward(self, handler: BaseHTTPRequestHandler, method: str, body: bytes) -> None:
        path = handler.path
        if method == "POST" and path == UPDATE_WEIGHTS and body:
            pushed = json.loads(body)
            self.pushes.append(pushed)
            if self.mode == "ignore" and "path" in pushed:
                self.version = pushed.get("version")
                return self.reply(handler, 200, json.dumps({"ok": True, "version": self.version}).encode(),
                                  {"content-type": "application/json"})
            if self.mode == "empty_adapter" and pushed.get("lora") and "path" in pushed:
                body = json.dumps({**pushed, "path": empty_adapter(pushed["path"])}).encode()
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            response = self.http.request(method, self.backend + path, content=body, headers=headers)
        except httpx.HTTPError:
            return self.reply(handler, 502, b"backend unreachable", {})
        content, out = response.content, {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        if self.mode == "ignore" and self.version is not None:
            if VERSION_HEADER in response.headers:
                out[VERSION_HEADER] = str(self.version)
            if path == INFO and response.status_code == 200:
                content = json.dumps({**response.json(), "policy_version": self.version}).encode()
        self.reply(handler, response.status_code, content, out)

    @staticmethod
    def reply(handler: BaseHTTPRequestHandler, status: int, content: bytes, headers: dict) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)


SHIFT = 1


def patch_image_positions(shift: int = SHIFT) -> None:
    """vLLM's Qwen3-VL M-RoPE positions of image tokens, h and w rows moved by `shift` (this process);
    the plugin's entry point, so called once in each of vLLM's processes (twice is harmless)."""
    import torch
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Model

    if getattr(Model, "_push_faults_shifted", False):
        return
    original = Model.get_mrope_input_positions

    def shifted(self, input_tokens, mm_features):
        positions, delta = original(self, input_tokens, mm_features)
        image = torch.tensor(input_tokens) == self.config.image_token_id
        positions = torch.as_tensor(positions).clone()
        positions[1:, image] += shift
        return positions, delta

    Model.get_mrope_input_positions = shifted
    Model._push_faults_shifted = True


def shifted_positions_env(folder: str | Path) -> dict[str, str]:
    """The environment for a `saccade serve` whose vLLM shifts image positions (module note): a
    dist-info under `folder` that names `patch_image_positions` a vLLM general plugin, and this
    folder, on PYTHONPATH."""
    import os

    info = Path(folder) / "push_faults_shift-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: push-faults-shift\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\npush_faults_shift = push_faults:patch_image_positions\n")
    path = os.pathsep.join(p for p in (str(folder), str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}
