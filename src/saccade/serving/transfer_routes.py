"""saccade serve's routes for the collective weight transfer, under vLLM's names for its phases
(the engine inside the workers: saccade.serving.transfer; the trainer's side:
saccade.transports.collective).

- `POST /init_weight_transfer_engine` {"init_info": {"master_address", "master_port", "world_size",
  "token"}}: join the trainer's gloo group (each worker then proves it holds the token:
  saccade.serving.rendezvous). A trainer that joins while another's update is half done ends
  that update as failed (generation stays paused until a complete one).
- `POST /shutdown_weight_transfer_engine`: leave the group (refused during an update).
- `POST /start_weight_update`: pause generation (as a folder update does) and begin vLLM's
  layerwise reload; the update holds the state's lock until it ends, so no folder update runs
  in between.
- each `POST /update_weights` {"update_info": {"names", "dtype_names", "shapes"}}: one layer group
  broadcast by the trainer (the route is the folder update's, `saccade.serving.server`, which
  hands such a body to `receive_chunk`). A failed chunk ends the update as failed.
- `POST /finish_weight_update` {"version": k}: end the reload, set the policy version and resume
  generation.
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types.

from typing import Any

from saccade.serving.state import SaccadeState, error, failed
from saccade.serving.validation import (
    RequestError, parse_finish, parse_transfer_chunk, parse_transfer_init, parse_vllm_transfer_chunk,
    parse_vllm_transfer_init,
)
from saccade.serving.wire import FINISH_UPDATE, GLOO_BACKEND, INIT_TRANSFER, SHUTDOWN_TRANSFER, START_UPDATE


def add_transfer_routes(router, state: SaccadeState) -> None:
    """The phases' routes on `router` (a FastAPI APIRouter), over `state`."""
    from fastapi import Request

    @router.post(INIT_TRANSFER)
    async def init_transfer(request: Request):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        try:
            body = await state.read_json(request)
            refusal = transfer_refusal(request, state)
            if refusal:
                raise refusal
            ours = backend_of(request) == GLOO_BACKEND
            info = parse_transfer_init(body) if ours else parse_vllm_transfer_init(body)
            session = info.pop("session", "")  # saccade's, not the engine's
            if not ours:
                info.pop("token", None)  # vLLM's workers prove no token (docs/security.md)
            if state.transfer_active and session == state.transfer_session:
                raise RequestError("a weight update is in progress: finish it first", 409)
        except RequestError as err:
            return error(err)
        if state.transfer_active:  # begun by a trainer that is gone (another joins): abandoned, half loaded
            try:
                await end_update(state, request.app.state.engine_client, complete=False)
            except Exception as err:  # noqa: BLE001
                return await failed("ending the abandoned weight update failed", err)
        state.transfer_joined, state.transfer_session = False, ""
        try:  # returns once every worker has joined the trainer's group
            await request.app.state.engine_client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        except Exception as err:  # noqa: BLE001 - the trainer learns why; the server stays up
            return await failed("joining the trainer's process group failed", err)
        state.transfer_joined, state.transfer_session = True, session
        return {"ok": True}

    @router.post(SHUTDOWN_TRANSFER)
    async def shutdown_transfer(request: Request):
        if state.transfer_active:
            return error(RequestError("a weight update is in progress: finish it first", 409))
        if state.transfer_joined:
            await request.app.state.engine_client.shutdown_weight_transfer_engine()
        state.transfer_joined, state.transfer_session = False, ""
        return {"ok": True}

    @router.post(START_UPDATE)
    async def start_update(request: Request):
        refusal = transfer_refusal(request, state)
        if refusal is None and not state.transfer_joined:
            refusal = RequestError("no trainer has joined: call /init_weight_transfer_engine first", 409)
        if refusal is None and state.transfer_active:
            refusal = RequestError("a weight update is already in progress", 409)
        if refusal:
            return error(refusal)
        await state.lock().acquire()  # held until /finish_weight_update: no folder update in between
        client = request.app.state.engine_client
        try:
            # As for a folder: requests running now finish on the old weights; new ones wait.
            await client.pause_generation(mode="wait", clear_cache=False)
            await client.start_weight_update()
        except Exception as err:  # noqa: BLE001
            if not state.weights_incomplete:
                await client.resume_generation()
            state.lock().release()
            return await failed("starting the weight update failed", err)
        state.transfer_active = True
        return {"ok": True}

    @router.post(FINISH_UPDATE)
    async def finish_update(request: Request):
        try:
            version = parse_finish(await state.read_optional_json(request), state.policy_version)
            if not state.transfer_active:
                raise RequestError("no weight update in progress: call /start_weight_update first", 409)
        except RequestError as err:
            return error(err)
        try:
            await end_update(state, request.app.state.engine_client, complete=True, version=version)
        except Exception as err:  # noqa: BLE001
            return await failed("finishing the weight update failed", err)
        return {"ok": True, "version": version}


async def receive_chunk(request, body: Any, state: SaccadeState):
    """One chunk of a collective update (`/update_weights` with "update_info"): returns once the
    trainer's broadcast of it has arrived and loaded."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    try:
        info = parse_transfer_chunk(body) if backend_of(request) == GLOO_BACKEND else parse_vllm_transfer_chunk(body)
        if not state.transfer_active:
            raise RequestError("no weight update in progress: call /start_weight_update first", 409)
    except RequestError as err:
        return error(err)
    client = request.app.state.engine_client
    try:  # returns once the trainer's broadcast of this chunk has arrived and loaded
        await client.update_weights(WeightTransferUpdateRequest(update_info=info))
    except Exception as err:  # noqa: BLE001 - half the weights are new: keep generation paused
        try:
            await end_update(state, client, complete=False)
        except Exception:  # noqa: BLE001, S110 - the first failure is the one reported
            pass
        return await failed("receiving weights failed; generation stays paused until a complete update", err)
    return {"ok": True, "tensors": len(info["names"]) if isinstance(info, dict) and "names" in info else None}


async def end_update(state: SaccadeState, client, *, complete: bool, version: int | None = None) -> None:
    """The update's end, finished or failed: vLLM's layerwise reload closed, what derives from the
    weights refreshed; generation resumes only after a complete update."""
    try:
        await client.finish_weight_update()
        await client.collective_rpc("saccade_after_reload")
        await client.reset_encoder_cache()
        await client.reset_prefix_cache()
    finally:
        state.transfer_active = False
        state.weights_incomplete = not complete
        if complete:
            state.policy_version = version
            state.base_modified = True
            await client.resume_generation()
        state.lock().release()


def transfer_refusal(request, state: SaccadeState) -> RequestError | None:
    """Why this server cannot take a collective update (no weight-transfer engine; no in-place
    reload), or None."""
    if request.app.state.vllm_config.weight_transfer_config is None:
        return RequestError("this server has no weight-transfer engine: start it with saccade serve (which passes "
                            "--weight-transfer-config), or sync through a folder (engine.weight_sync = \"files\")", 501)
    refusal = state.weight_updates_refusal(request)
    if refusal:
        return RequestError(f"this server cannot load new weights: {refusal}", 501)
    return None


def backend_of(request) -> str | None:
    """The weight-transfer backend this server's workers built (--weight-transfer-config), or None."""
    config = request.app.state.vllm_config.weight_transfer_config
    return None if config is None else config.backend


async def transfer_info(request, state: SaccadeState) -> dict | None:
    """The collective weight transfer this server offers: its backend, how many workers join the
    trainer's group (the group's size is that + the trainer's ranks), each worker's device (type,
    a GPU's UUID: the trainer decides what can reach them) and the session of the trainer that
    joined last ("" for none), or None without one."""
    vllm_config = request.app.state.vllm_config
    config = vllm_config.weight_transfer_config
    if config is None:
        return None
    return {"backend": config.backend, "workers": int(vllm_config.parallel_config.world_size_across_dp),
            "devices": await state.worker_devices(request),
            "session": state.transfer_session if state.transfer_joined else ""}
