"""How the trainer's weights reach vLLM servers (`engine.weight_sync`): one file for each way, each
a `saccade.inference.engine.WeightTransport` that `VLLMEngine.update_weights` calls on every rank.

- `files.py`: full weights (LoRA merged) written to a folder, which each server reads back;
- `adapter.py`: with LoRA, only the adapter's folder, which each server loads in place;
- `collective.py`: full weights broadcast layer group by layer group over a process group with
  each server's workers (vLLM's weight-transfer protocol), no files;
- `choose.py`: which of them a run's config and its servers allow (`auto` included), and the
  transport built for it.

What is sent (names, dtypes, order, groups) is the trainer's (`saccade.trainer.transfer_plan`,
`saccade.trainer.checkpoint.engine_weights`); the HTTP to the servers is the engine's client
(`saccade.inference.server_client`). The trainer hands weights to a transport and never talks to
a server itself. A new way to send weights is a new file here and a variant of `engine.weight_sync`.
"""
