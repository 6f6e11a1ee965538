"""GPU memory estimates for a run: the trainer (LM only, LoRA or full) and a vLLM server.

Pure arithmetic over the model's dimensions (`saccade.tools.memory_dims`, from its config.json): no
torch, nothing loaded. `saccade memory CONFIG`
prints it; the Qwen3-VL configs in `saccade/configs/` carry its numbers in their headers (a
test keeps them equal). These are estimates, not measurements: no GPU was at hand when they
were written. What was checked, on CPU with the tiny model: the parameter counts equal the
real modules' exactly, and the activation bytes equal what autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`, tests/tools/test_memory.py).

What the trainer holds at its peak (the start of backward on the largest micro-batch):
- weights: the language model and lm_head in `model.dtype`; never the vision tower with a
  vLLM engine (the servers encode images). The embedded engine loads the tower here too.
- the KL term's reference (`loss.kl_coef` > 0): full fine-tuning holds a frozen copy of the
  language model and lm_head in `model.dtype` (`saccade.trainer.reference.frozen_copy`); LoRA's
  reference is its own frozen base with the adapters off, nothing more.
- trainable state: peft keeps LoRA adapters in float32 (its `autocast_adapter_dtype`), so
  LoRA params, grads and AdamW's two moments are 4 bytes each. Full fine-tuning in bf16
  keeps float32 master weights beside the bf16 ones the model computes with
  (`saccade.trainer.step.MasterWeights`): masters, their gradients and AdamW's moments are
  4 bytes each (in float32 the weights are their own masters).
- activations: what autograd keeps for backward over `trainer.max_tokens` tokens. Without
  activation checkpointing every layer's are alive at once; with it, each layer's input
  and one layer's activations while its backward runs (`activation_bytes_per_token` spells
  out both formulas).
- logprob buffers: `saccade.trainer.logprobs` never builds the (tokens x vocab) logits; it
  holds two (chunk x vocab) float32 buffers and, when the lm_head trains, a float32 (vocab x
  hidden) gradient accumulator. On a GPU the lm_head's bf16 matmuls write float32 directly
  (`saccade.models.head`): no float32 copy of the weight (the CPU makes one per forward).
- two micro-batches' inputs, image embeddings (main + DeepStack levels) above all, each
  bounded by max_tokens rows: the one being computed and the next, already on its way
  (`saccade.trainer.step.on_device`); the step's other micro-batches wait in host memory.
- CUDA context: an assumed 0.5 GiB; allocator fragmentation is not modelled.

Under FSDP2 (`world_size` N > 1: torchrun, `saccade.trainer.sharding.shard_model`: `fully_shard`
on every decoder layer, then on the PolicyLM as the root), the figures are per rank:
- every parameter is sharded dim-0 over the N ranks: weights, gradients and AdamW's moments
  are 1/N each (rounding each parameter's rows up to a multiple of N is ignored: under one
  row per parameter per rank);
- sharded full fine-tuning loads the model in float32 (`saccade.run.setup.weights_dtype`) and
  FSDP's mixed precision computes in `model.dtype` (bf16 all-gathers, float32 gradient
  reduction): the sharded parameters are float32 (`FSDP_PARAM_BYTES`) and AdamW steps them
  directly, no separate master copy: 4 + 4 (gradients) + 8 (moments) bytes per parameter,
  over N. LoRA is stored as in one process (`saccade.trainer.sharding.mixed_precision`): the
  frozen base in `model.dtype` over N, the float32 adapters, their gradients and moments
  over N; full fine-tuning's KL reference copy is sharded like the policy: `model.dtype`
  shards, over N;
- transient whole copies, as computed (the compute dtype; LoRA's adapters float32): FSDP
  all-gathers one decoder layer at a time
  and prefetches the next, so two layers are counted in flight (forward and backward alike);
  the root's own parameters (embedding, final norm, lm_head) stay whole from forward to
  backward (the root does not reshard after forward). A layer's whole gradient, before its
  reduce-scatter, exists while that layer's own saved activations are being freed: not
  counted. The KL reference copy's forwards come before the training pass and keep no
  activations; its layers are gathered one at a time like the policy's and its root is
  sharded again after each micro-batch: not counted either;
- activations, logprob buffers, image embeddings and the CUDA context are per rank and not
  divided: each rank runs its own micro-batches of up to `trainer.max_tokens` tokens.
  The activation formula is the single process's (peft's float32 input copies included: the
  adapters compute in float32 sharded too);
- not modelled: NCCL's buffers and workspace, and the embedded engine's rollouts, during
  which every parameter is held whole (`saccade.distributed.unsharded`). The vision tower
  (embedded engine) is not sharded.
`world_size` 1 is the single process (no FSDP); `fsdp=True` at world size 1 models torchrun
with one process, which takes the FSDP path.

A vLLM server holds the whole model (LM + vision tower) in bf16, LoRA slots when it is
started with --enable-lora, an assumed 3 GiB of non-KV overhead (profiling activations,
CUDA graphs, encoder cache; vLLM logs the real figure as "Available KV cache memory") and
gives the rest of `--gpu-memory-utilization` x GPU to the KV cache. The trainer's world size
does not change it.
"""

from __future__ import annotations

from dataclasses import dataclass

from saccade.tools.memory_dims import LINEARS, ModelDims, TextDims, model_dims

GiB = 1024**3
GPU_GIB = 79.0  # what CUDA shows of an 80 GB H100 / A100 (nvidia-smi: 81,559 MiB), rounded down
CUDA_CONTEXT_GIB = 0.5  # assumed
VLLM_OVERHEAD_GIB = 3.0  # assumed: vLLM's profiling activations, CUDA graphs, encoder cache
# Micro-batches on the device at once: the one computed and the next (saccade.trainer.step.on_device).
MICRO_BATCHES_RESIDENT = 2
LOGPROB_CHUNK = 1024  # saccade.trainer.forward.forward_logprobs' default chunk_size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
UNSHARDED_LAYERS = 2  # FSDP2: decoder layers held whole at once, the one computing and the one prefetched
FSDP_PARAM_BYTES = 4  # sharded full fine-tuning: float32 shards (FSDP mixed precision computes in bf16)


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def activation_bytes_per_token(
    text: TextDims, *, dtype_bytes: int, lora_rank: int | None, lora_targets: tuple[str, ...] = LINEARS,
    loss_fraction: float = 1.0, checkpointing: bool = False,
) -> float:
    """Bytes kept for backward per token of a micro-batch (transformers' dense text
    decoder, peft LoRA or full fine-tuning, flash or sdpa attention), at the peak.

    With `checkpointing` (per-layer activation checkpointing): each layer's input hidden
    state, b*h, held for the recompute; RoPE's cos and sin, shared by all layers; one layer's
    activations (the per-layer term below) while that layer's backward runs; and the
    per-token terms outside the layers. Exact against what autograd saves outside the layers
    and what the checkpoints hold (tests/tools/test_memory.py).

    Without it (what follows), everything autograd saves, every layer's at once.

    Per decoder layer, with b the dtype's bytes, h hidden, q = heads*head_dim, kv =
    kv_heads*head_dim, I intermediate:
      RMSNorm (x2 per layer, and q_norm over q, k_norm over kv): the float32 upcast of its
        input, 4*n, and one float32 rsqrt per row; full FT also the normalised input, b*n,
        for the weight's gradient.
      attention: q, k, v after RoPE and the output, b*(2q + 2kv), + float32 logsumexp per head.
      MLP: gate and up outputs and silu(gate), 3*b*I.
      the linears' inputs, kept for their weight gradients: full FT keeps the three shared
        inputs (norm1 out b*h, shared by q/k/v; attention out, already counted; norm2 out b*h,
        shared by gate/up; silu*up b*I). LoRA keeps them only for adapted linears, and peft,
        whose adapters are float32, casts each adapted linear's input to float32 on its own:
        in bf16 that is one 4*in copy per adapted linear (q, k, v each copy the same h); in
        float32 the cast is a no-op and inputs are shared. Plus each adapter's rank-r
        intermediate, 4*r.
    So bf16, LoRA on all seven linears: 28h + 12q + 8kv + 10I + 28r + 8 heads + 4 kv_heads + 8;
    bf16 full FT: 16h + 10q + 10kv + 8I + 8 heads + 4 kv_heads + 8.
    Once per token: RoPE cos and sin (2*b*head_dim), the final norm, the token ids for the
    embedding's gradient (full FT, int64), and per loss token the gathered hidden state (b*h),
    its source row, its own row and its target (int64) and the logsumexp and entropy (float32).
    The loss (`saccade.trainer.loss.policy_loss`) adds a few float32 per token: not counted.
    With LoRA the first layer's input norm keeps nothing (nothing before it trains).

    Exact for LoRA on all seven linears and for full fine-tuning (tested against autograd's
    saved tensors on the tiny model); for other target sets the first layer is approximate.
    Not counted: DeepStack's per-image-token index masks (a few bytes per image token);
    eager attention's (tokens x tokens) probabilities (use flash_attention_2 or sdpa);
    packed_sdpa's layout: its q, k, v and output are held as right-padded batches (the pads of
    `length_buckets`, under 2x a sample's own length) and, in float32 on the CPU, the output
    once more in row order (b*q per token per layer). Shared prompts (trainer.share_prompts)
    shrink the token count itself: a group's prompt is held once, not G times.
    """
    full = lora_rank is None
    targets = set() if full else set(lora_targets)
    b = dtype_bytes
    h, q, kv, inter = text.hidden_size, text.q_dim, text.kv_dim, text.intermediate_size
    cast = b != 4  # peft's float32 adapters: each adapted linear copies its input to float32

    def norm(n: int, rows: int) -> int:
        return 4 * n + 4 * rows + (b * n if full else 0)

    def inputs(names: tuple[str, ...], n: int) -> int:
        if full:
            return b * n
        adapted = sum(name in targets for name in names)
        if not adapted:
            return 0
        return 4 * n * adapted if cast else b * n

    attention = (
        norm(h, 1)
        + inputs(("q_proj", "k_proj", "v_proj"), h)
        + norm(q, text.num_attention_heads)
        + norm(kv, text.num_key_value_heads)
        + b * (2 * q + 2 * kv) + 4 * text.num_attention_heads
        + (2 * b * q if text.attention_output_gate else 0)  # the gate's sigmoid and the ungated output
        + (4 * q if cast and "o_proj" in targets else 0)  # otherwise shared with attention's output
        + norm(h, 1)
        + 4 * (lora_rank or 0) * len(targets & set(LINEARS[:4]))
    )
    dense = (
        attention
        + inputs(("gate_proj", "up_proj"), h)
        + 3 * b * inter
        + inputs(("down_proj",), inter)
        + 4 * (lora_rank or 0) * len(targets & set(LINEARS[4:]))
    )
    moe = attention + text.experts.activation_bytes(b, h) if text.moe_layers else 0  # memory_dims.ExpertDims'
    linear = 0  # a hybrid's linear-attention layer: its mixer instead of attention (LinearAttentionDims')
    if text.linear_layers:
        mixer = text.linear_attention
        adapted = sum(n in targets for n in mixer.linear_shapes(h))
        linear = (dense - attention + 2 * norm(h, 1) + inputs(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), h)
                  + mixer.activation_bytes(b, h) + inputs(("out_proj",), mixer.value_dim) + 4 * (lora_rank or 0) * adapted)
    dense_layers = text.num_hidden_layers - text.moe_layers
    rope = 2 * b * text.head_dim  # cos, sin: computed once, shared by every layer
    if checkpointing:  # inputs held, the largest layer recomputed
        # A linear-attention layer's MLP is the dense one or, in a hybrid MoE (Qwen3.5-MoE), the experts.
        largest_mlp_layer = max(dense if dense_layers else 0, moe)
        linear_layer = linear - dense + largest_mlp_layer if text.linear_layers else 0
        per_token = text.num_hidden_layers * b * h + max(largest_mlp_layer, linear_layer)
    else:
        per_token = dense_layers * dense + text.moe_layers * moe + text.linear_layers * (linear - dense)
        if not full:
            per_token -= norm(h, 1)  # layer 0's input norm: nothing before it requires grad
    return per_token + rope + outside_layers_bytes_per_token(text, dtype_bytes=b, full=full, loss_fraction=loss_fraction)


def outside_layers_bytes_per_token(text: TextDims, *, dtype_bytes: int, full: bool, loss_fraction: float) -> float:
    """What autograd saves per token outside the decoder layers: the final norm, the token ids
    for the embedding's gradient (full fine-tuning), and per loss token the gathered hidden
    state, its source row, its own row (where its logprob is put back) and its target, the
    logsumexp and entropy."""
    b, h = dtype_bytes, text.hidden_size
    final_norm = 4 * h + 4 + (b * h if full else 0)
    return final_norm + (8 if full else 0) + loss_fraction * (b * h + 8 + 8 + 8 + 4 + 4)


# ---------------------------------------------------------------------------------------------
# Estimates
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    name: str
    gib: float
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    """Rows of a memory estimate; `total` is the peak (rows add up to it)."""

    items: tuple[Item, ...]

    @property
    def total(self) -> float:
        return sum(i.gib for i in self.items)

    def get(self, name: str) -> float:
        return sum(i.gib for i in self.items if i.name == name)


def trainer_memory(
    dims: ModelDims, *, dtype: str = "bfloat16", lora_rank: int | None = 16, lora_targets: tuple[str, ...] | None = None,
    max_tokens: int = 4096, holds_vision_tower: bool = False, loss_fraction: float = 1.0,
    chunk_size: int = LOGPROB_CHUNK, activation_checkpointing: bool = False, world_size: int = 1,
    fsdp: bool | None = None, kl_reference: bool = False,
) -> Estimate:
    """Peak GPU memory of the trainer, per rank. `lora_rank=None` is full fine-tuning of the language model;
    `lora_targets` empty or None: the family's own (`dims.lora_targets`), as a run with them unset.

    `loss_fraction`, the share of micro-batch tokens that are completion tokens, is 1 by default
    (an upper bound). The peak is the larger of the backward peak (everything below) and the
    optimizer step's (foreach AdamW allocates about one parameter-sized temporary while the
    activations are already freed); the second wins only for full fine-tuning with few tokens.

    `world_size` N > 1 is FSDP2 full sharding over N ranks (the module docstring says what is
    divided by N and what is added); `fsdp` forces the FSDP path on or off (default: N > 1).

    `kl_reference`: the KL term is on (`loss.kl_coef` > 0). Full fine-tuning then holds one more
    copy of the language model in `dtype`, over N when sharded; LoRA nothing more.
    """
    if world_size < 1:
        raise ValueError(f"the world size (--world-size) must be >= 1, got {world_size}")
    sharded = world_size > 1 if fsdp is None else fsdp
    n = world_size if sharded else 1
    b = DTYPE_BYTES[dtype]
    t = dims.text
    full = lora_rank is None
    lora_targets = lora_targets or dims.lora_targets
    lm_params = t.params
    size = f"{lm_params / 1e9:.2f}B params" + (f" ({t.active_params / 1e9:.2f}B active per token)" * bool(t.moe_layers))
    trainable = lm_params if full else t.lora_params(lora_rank, lora_targets)
    state_bytes = 4  # LoRA adapters, full fine-tuning's master weights (or FSDP's fp32 shards), float32
    of_n = f", 1/{n} per rank" if sharded else ""
    if sharded and full:
        # FSDP mixed precision: float32 shards (what AdamW steps), all-gathered in the compute dtype.
        weights = Item("weights", lm_params * FSDP_PARAM_BYTES / GiB / n,
                       f"language model + lm_head, {size}, fp32 shards{of_n}; "
                       f"all-gathered in {dtype}")
    elif sharded:  # a frozen LoRA base: stored and gathered in the compute dtype, as in one process
        weights = Item("weights", lm_params * b / GiB / n,
                       f"language model + lm_head, frozen base, {size}, {dtype} shards{of_n}")
    else:
        weights = Item("weights", lm_params * b / GiB,
                       f"language model + lm_head, {size}, {dtype}")
    items = [weights]
    if kl_reference and full:
        items.append(Item("KL reference", lm_params * b / GiB / n,
                          f"frozen copy of the language model + lm_head, {dtype}" + (f" shards{of_n}" if sharded else "")))
    if holds_vision_tower:
        items.append(Item("vision tower", dims.vision.params * b / GiB, "embedded engine: the tower lives here"
                          + (" (not sharded)" if sharded else "")))
    if not full:
        items.append(Item("LoRA adapters", trainable * 4 / GiB / n,
                          f"rank {lora_rank}, {trainable / 1e6:.1f}M params, fp32{of_n}"))
    elif b != 4 and not sharded:
        items.append(Item("master weights", trainable * 4 / GiB, "fp32 copies the optimizer steps"))
    if not full and t.moe_layers:  # peft's expert adapters keep each MoE layer's W + BA for backward
        kept = 1 if activation_checkpointing else t.moe_layers
        items.append(Item("expert LoRA merged weights", kept * t.experts.merged_bytes(t.hidden_size, b) / GiB,
                          f"{kept} MoE layer(s)' W + BA, {dtype}, kept for backward (estimate from peft's code)"))
    items.append(Item("gradients", trainable * state_bytes / GiB / n,
                      "fp32, reduce-scattered" + of_n if sharded else "fp32"))
    items.append(Item("AdamW states", 2 * trainable * state_bytes / GiB / n, "exp_avg, exp_avg_sq" + of_n))
    per_token = activation_bytes_per_token(
        t, dtype_bytes=b, lora_rank=lora_rank, lora_targets=lora_targets, loss_fraction=loss_fraction,
        checkpointing=activation_checkpointing,
    )
    activations = max_tokens * per_token / GiB
    head_grad = t.vocab_size * t.hidden_size * 4 if full else 0  # float32 accumulator of the lm_head grad
    logprob = (2 * chunk_size * t.vocab_size * 4 + head_grad) / GiB
    images = MICRO_BATCHES_RESIDENT * max_tokens * t.hidden_size * (1 + dims.vision.deepstack_levels) * b / GiB
    how = "per-layer checkpointing" if activation_checkpointing else "no checkpointing"
    backward = [
        Item("activations", activations, f"{max_tokens} tokens x {per_token / 2**20:.2f} MiB, {how}"
             + (", per rank" if sharded else "")),
        Item("logprob buffers", logprob, f"2 x ({chunk_size} x vocab) fp32" + (" + the lm_head's fp32 gradient"
                                                                                if full else "")),
        Item("image embeddings", images, f"{MICRO_BATCHES_RESIDENT} micro-batches' (computing, next), at most "
             "max_tokens rows each (main + DeepStack)"),
    ]
    if sharded:
        # A layer whole: its base in the compute dtype, LoRA's adapters in float32 (gathered as stored).
        layer_bytes = t.layer_params * b + (0 if full else t.lora_params(lora_rank, lora_targets)
                                            // t.num_hidden_layers * 4)
        root = t.params - t.decoder_params()  # embedding, final norm, untied lm_head
        backward[:0] = [
            Item("unsharded layers", UNSHARDED_LAYERS * layer_bytes / GiB,
                 f"{UNSHARDED_LAYERS} decoder layers all-gathered (one computing, one prefetched)"),
            Item("unsharded root", root * b / GiB,
                 f"embedding, final norm, lm_head all-gathered in {dtype}, kept from forward to backward"),
        ]
    step_temp = trainable * state_bytes / GiB / n
    if step_temp > sum(i.gib for i in backward):
        items.append(Item("optimizer step temporaries", step_temp, "foreach AdamW; exceeds the backward's"))
    else:
        items.extend(backward)
    items.append(Item("CUDA context", CUDA_CONTEXT_GIB, "assumed"))
    return Estimate(tuple(items))


def server_memory(
    dims: ModelDims, *, gpu_memory_utilization: float, gpu_gib: float = GPU_GIB, dtype: str = "bfloat16",
    max_lora_rank: int | None = None, overhead_gib: float = VLLM_OVERHEAD_GIB,
) -> Estimate:
    """A vLLM server's share of its GPU: weights, LoRA slots, overhead, and the KV cache it gets."""
    b = DTYPE_BYTES[dtype]
    budget = gpu_memory_utilization * gpu_gib
    items = [Item("weights", dims.params * b / GiB, f"LM + vision tower, {dims.params / 1e9:.2f}B params, {dtype}")]
    if max_lora_rank:
        lora = dims.text.lora_params(max_lora_rank, dims.lora_targets) * b / GiB
        items.append(Item("LoRA slot", lora, f"--enable-lora --max-lora-rank {max_lora_rank}, one adapter"))
    items.append(Item("overhead", overhead_gib, "assumed: profiling activations, CUDA graphs, encoder cache"))
    kv = budget - sum(i.gib for i in items)
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {gpu_memory_utilization} gives {budget:.1f} GiB, less than the "
            f"{budget - kv:.1f} GiB the server needs before its KV cache"
        )
    items.append(Item("KV cache", kv, f"{kv_tokens(dims, kv):,} tokens"))
    return Estimate(tuple(items))


def kv_tokens(dims: ModelDims, kv_gib: float, dtype_bytes: int = 2) -> int:
    """Tokens of KV cache that `kv_gib` holds, rounded down to a thousand."""
    return int(kv_gib * GiB / dims.text.kv_bytes_per_token(dtype_bytes)) // 1000 * 1000


# ---------------------------------------------------------------------------------------------
# From a run config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunEstimate:
    """A run's trainer and one of its servers, and whether they fit their GPUs."""

    dims: ModelDims
    trainer: Estimate
    server: Estimate | None  # None for the embedded engine
    gpu_gib: float
    shared_gpu: bool  # the trainer (each rank of it) and one server on the same GPU
    world_size: int = 1  # the trainer's ranks; `trainer` is per rank (FSDP2 at world size > 1)

    @property
    def trainer_budget(self) -> float:
        """What the trainer may use: its GPU, less the server's share when they share it."""
        return self.gpu_gib - (self.server.total if self.shared_gpu and self.server else 0.0)

    @property
    def fits(self) -> bool:
        return self.trainer.total <= self.trainer_budget


def estimate_run(cfg, *, gpu_memory_utilization: float | None = None, gpu_gib: float = GPU_GIB,
                 shared_gpu: bool | None = None, dims: ModelDims | None = None,
                 world_size: int | None = None) -> RunEstimate:
    """The estimate for a `saccade.config.RunConfig`.

    What is not given comes from the config's `[launch]` layout (`launch_shape`): the servers'
    --gpu-memory-utilization, whether a server and a trainer rank share a GPU (`shared_gpu`:
    start the server first, vLLM takes its share of the whole GPU and the trainer fits in what
    is left; at world size > 1 each rank shares its GPU with one server), and the trainer's
    ranks (`world_size`: the trainer's figures are per rank under FSDP2; the server's do not change).
    """
    layout = launch_shape(cfg)
    gpu_memory_utilization = layout[0] if gpu_memory_utilization is None else gpu_memory_utilization
    shared_gpu = layout[1] if shared_gpu is None else shared_gpu
    world_size = layout[2] if world_size is None else world_size
    dims = dims or model_dims(cfg.model.path)
    lora = cfg.lora  # None: full fine-tuning
    embedded = cfg.engine.kind == "embedded"
    trainer = trainer_memory(
        dims, dtype=cfg.model.dtype, lora_rank=lora.rank if lora else None,
        lora_targets=tuple(lora.target_modules or ()) if lora else (),
        max_tokens=cfg.trainer.max_tokens, holds_vision_tower=embedded,
        activation_checkpointing=cfg.trainer.activation_checkpointing, world_size=world_size,
        kl_reference=cfg.loss.kl_coef > 0,
    )
    server = None
    if not embedded:
        server = server_memory(
            dims, gpu_memory_utilization=gpu_memory_utilization, gpu_gib=gpu_gib, dtype=cfg.model.dtype,
            max_lora_rank=lora.rank if lora and cfg.engine.weight_sync.kind == "adapter" else None,
        )
    return RunEstimate(dims, trainer, server, gpu_gib, shared_gpu and not embedded, world_size)


def launch_shape(cfg) -> tuple[float, bool, int]:
    """(--gpu-memory-utilization, a server shares a GPU with a trainer rank, trainer ranks) of the
    config's [launch] layout; without nodes, the section's defaults: 0.9, no, 1."""
    launch = cfg.launch
    return launch.gpu_memory_utilization, launch.shares_gpu(), launch.world_size


def header_lines(est: RunEstimate) -> list[str]:
    """The memory lines of a shipped config's header, exactly (tests/test_configs.py compares).

    At world size 1 they say "trainer GPU" (one process); above it, the trainer's lines say
    "per rank of N (FSDP2)" and name the unsharded copies, so a header states the world size
    its figures are for."""
    t = est.trainer
    n = est.world_size
    state = "LoRA+grads+AdamW" if t.get("LoRA adapters") else "masters+grads+AdamW" if t.get("master weights") \
        else "grads+AdamW"
    short = {"LoRA adapters": state, "master weights": state, "gradients": state, "AdamW states": state,
             "logprob buffers": "logprobs", "image embeddings": "images", "CUDA context": "context"}
    if n > 1:
        short["weights"] = "weight shards"
    groups: dict[str, float] = {}
    for item in t.items:
        key = short.get(item.name, item.name)
        groups[key] = groups.get(key, 0.0) + item.gib
    parts = " + ".join(f"{name} {gib:.1f}" for name, gib in groups.items())
    who = "trainer GPU" if n == 1 else f"trainer GPU, per rank of {n} (FSDP2)"
    lines = [f"#   {who}: {t.total:.1f} GiB peak = {parts}"]
    if est.server is not None:
        s = est.server
        kv = s.get("KV cache")
        lines.append(
            f"#   each vLLM server: {s.total:.1f} GiB = weights {s.get('weights'):.1f}"
            + (f" + LoRA slot {s.get('LoRA slot'):.1f}" if s.get("LoRA slot") else "")
            + f" + overhead {s.get('overhead'):.1f} (assumed) + KV cache {kv:.1f} ({kv_tokens(est.dims, kv):,} tokens)"
        )
    where = "next to its server" if est.shared_gpu else "alone"
    verdict = "fits" if est.fits else "DOES NOT FIT"
    who = "trainer" if n == 1 else f"each of the {n} trainer ranks"
    lines.append(
        f"#   {who} {where} on a {est.gpu_gib:.0f} GiB GPU: {t.total:.1f} of {est.trainer_budget:.1f} GiB, {verdict}"
    )
    return lines
