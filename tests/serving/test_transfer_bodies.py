"""The collective weight transfer's wire, both ends without a server: the checks on the routes'
bodies (saccade.serving.validation: saccade's gloo, field by field; vLLM's backends, saccade's own
fields), the chunk format the workers cut back into tensors (saccade.serving.transfer), and what
`saccade serve` refuses at start for a backend (saccade.serving.flags). Against a real server:
test_vllm_weight_transfer.py."""

from __future__ import annotations

import pytest
import torch

from saccade.serving.validation import RequestError, parse_finish, parse_transfer_chunk, parse_transfer_init


def test_transfer_bodies_are_checked():
    info = {"master_address": "10.0.0.1", "master_port": 29600, "world_size": 2, "session": "ab12", "token": "f" * 32}
    assert parse_transfer_init({"init_info": info}) == info
    without_token = {k: v for k, v in info.items() if k != "token"}
    for bad in ({"init_info": {**info, "master_port": 0}}, {"init_info": {**info, "world_size": 1}},
                {"init_info": without_token}, {"init_info": {**info, "token": "short"}},
                {"init_info": {**info, "rank": 3}}, {"init_info": {**info, "master_address": ""}},
                {"init_info": {**info, "session": 7}}, {}):
        with pytest.raises(RequestError):
            parse_transfer_init(bad)
    chunk = {"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}}
    assert parse_transfer_chunk(chunk) == chunk["update_info"]
    for bad in ({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2], [3]]},
                {"names": ["a"], "dtype_names": ["complex64"], "shapes": [[2]]},
                {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]},
                {"names": [], "dtype_names": [], "shapes": []}):
        with pytest.raises(RequestError):
            parse_transfer_chunk({"update_info": bad})
    assert parse_finish(None, 4) == 5 and parse_finish({"version": 9}, 4) == 9
    with pytest.raises(RequestError):
        parse_finish({"version": -1}, 4)


def test_chunk_views_cut_the_bytes_back_into_tensors():
    pytest.importorskip("vllm", reason="saccade.serving.transfer is vLLM's engine class")
    from saccade.serving.transfer import chunk_nbytes, chunk_views

    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.int64).reshape(2, 3)
    c, d = torch.randn(5).to(torch.bfloat16), torch.randn(2)  # d starts off float32's alignment
    buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in (a, b, c, d)])
    dtypes, shapes = ["float32", "int64", "bfloat16", "float32"], [[3, 4], [2, 3], [5], [2]]
    assert chunk_nbytes(dtypes, shapes) == buffer.numel()
    got = chunk_views(buffer, dtypes, shapes)
    assert all(torch.equal(x, y) for x, y in zip(got, (a, b, c, d), strict=True))
    with pytest.raises(ValueError):
        chunk_views(buffer[:-2], dtypes, shapes)


def test_vllm_backends_bodies_are_passed_on_with_saccades_own_fields_checked():
    from saccade.serving.validation import parse_vllm_transfer_chunk, parse_vllm_transfer_init

    info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 3, "world_size": 5, "packed": True,
            "session": "ab12", "token": "f" * 32}
    assert parse_vllm_transfer_init({"init_info": info}) == info  # vLLM's engine checks its own fields
    assert parse_vllm_transfer_init({"init_info": {"packed": True}}) == {"packed": True}  # ipc: no rendezvous
    for bad in ({"init_info": {**info, "session": 7}}, {"init_info": [1]}, {"init_info": {f"k{i}": i for i in range(65)}},
                {"other": {}}):
        with pytest.raises(RequestError):
            parse_vllm_transfer_init(bad)
    chunk = {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]], "num_updates_list": [1]}
    assert parse_vllm_transfer_chunk({"update_info": chunk}) == chunk
    assert parse_vllm_transfer_chunk({"update_info": [chunk, chunk]}) == [chunk, chunk]
    for bad in ({"update_info": 3}, {"update_info": []}, {"update_info": [chunk, 4]}):
        with pytest.raises(RequestError):
            parse_vllm_transfer_chunk(bad)


def test_a_gpu_backend_on_a_cpu_server_and_ipc_beyond_loopback_are_refused_at_start():
    from saccade.serving.flags import check_weight_transfer, transfer_backend

    environ: dict = {}
    assert check_weight_transfer("saccade_gloo", on_cpu=True, host="127.0.0.1", environ=environ) is None
    for backend in ("nccl", "ipc", "sparse_nccl", "nccl_m2n"):
        with pytest.raises(SystemExit, match=f"names '{backend}', which needs GPUs, and this server runs on the CPU"):
            check_weight_transfer(backend, on_cpu=True, host="127.0.0.1", environ=environ)
    assert check_weight_transfer("nccl", on_cpu=False, host="0.0.0.0", environ=environ) is None
    with pytest.raises(SystemExit, match="listens on loopback only"):
        check_weight_transfer("ipc", on_cpu=False, host="0.0.0.0", environ=environ)
    assert environ == {}
    note = check_weight_transfer("ipc", on_cpu=False, host="127.0.0.1", environ=environ)
    assert "unpickle" in note and environ == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert transfer_backend({"backend": "nccl"}) == "nccl" and transfer_backend(None) is None
