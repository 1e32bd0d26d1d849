"""Config of the inference server (`tandem inference`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import ProcessConfig, Section
from tandem.config.lora import LoraConfig
from tandem.config.secret import Secret
from tandem.config.vllm import VllmConfig

BaseServing = Literal["off", "where_possible", "required"]
"""Whether tandem's engine serves the base model beside a LoRA policy (`InferenceConfig.base_serving`)."""


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address to bind; loopback by default so a run never listens on the network unasked."""

    port: int = 8000
    """TCP port of the OpenAI-compatible API; under `tandem rl`, 0 picks a free port when the run is resolved."""

    api_key: Secret = None
    """When set, every request but `GET /health` must carry `Authorization: Bearer <api_key>`. A secret: redacted
    wherever tandem writes or prints a config."""

    access_log: bool = False
    """Log one line per HTTP request (an RL run sends thousands; off keeps the log readable)."""

    weight_transfer_timeout_s: float = Field(300.0, gt=0)
    """Broadcast weight transport: longest wait of this server for its group to form or for one
    update's tensors to arrive, after which the call fails (and the run stops) instead of hanging."""

    switch_interval_ms: float | None = Field(None, gt=0)
    """How long the server's HTTP side may hold Python's interpreter lock while the engine thread waits for it,
    before it is made to let go (`sys.setswitchinterval`); unset: Python's 5 ms. Each time the engine thread comes
    back from the device (a step's tokens read) it needs the lock, so under a busy event loop (many streams, KV
    hand-offs received) a step can wait that long several times; a shorter interval shortens those waits and
    interrupts the event loop more often."""

    max_request_bytes: int = Field(2**20, ge=1024)
    """Largest request body; a longer one is refused (413) before it is read. 1 MiB holds a 128k-token prompt
    as token ids or as text. Parsing a body holds the event loop (tens of milliseconds per MiB, the most for a
    long list of one-digit ids), so a larger limit lets one request delay every other request by that much."""

    base_model_name: str | None = None
    """With LoRA (`engine.lora`): the name the base model, without adapters, is served under beside the policy
    (`model.name`), for evals against the start; unset: `<model.name>-base`. The vLLM backend serves both (the
    policy as a LoRA adapter, updated in place). Tandem's engine computes base requests in the same steps as the
    policy's, the adapters subtracted from their rows (a step holding any runs without CUDA graphs); it serves the
    base where every adapted projection takes that path (not latent attention, not `engine.lora.target_experts`),
    and not with `run.exact`, `engine.speculative` or prefill/decode disaggregation. Set, it is an error where the base cannot be served;
    unset, the base is then not served."""

    @property
    def url(self) -> str:
        """The base URL clients reach this server at."""
        return f"http://{self.host}:{self.port}"


class SpeculativeConfig(Section):
    """Speculative decoding: a draft proposes tokens, the policy checks them all in one forward and keeps the
    longest run it would itself have sampled; the tokens drawn and their logprobs follow the policy's own
    distribution, as without speculation (`tandem/inference/engine/speculative.py`)."""

    method: Literal["off", "ngram", "draft_model", "mtp"] = "off"
    """`ngram`: prompt lookup, no weights (the tokens that followed the latest earlier occurrence of the
    sequence's last tokens); pays where outputs copy their context (code edits, tool outputs). `draft_model`:
    a smaller model of the same tokenizer (`draft_model`). `mtp`: the policy's own multi-token prediction layer
    (GLM-5 and DeepSeek-V3 checkpoints, or a draft head from `tandem model add-draft-head`), drafting from the
    policy's hidden states; part of the policy's weights,
    so a weight update that carries it keeps the draft with the policy. Each draft past the first chains the
    (first) layer on its own output."""

    num_tokens: int = Field(4, ge=1)
    """Most tokens drafted per sequence and step (k); the policy's forward then computes k + 1 tokens of it."""

    ngram_max: int = Field(4, ge=1)
    """`ngram`: the longest suffix of the sequence looked up (from `ngram_max` tokens down to 1)."""

    min_expected_tokens: float = Field(0.5, ge=0)
    """`ngram`: a step drafts only when its decoding sequences are expected to gain at least this many accepted
    drafts each, on average, judged by how often prompt lookup would have guessed each sequence's recent tokens
    (its moving hit rate h gives h + h^2 + ... + h^k). A verifying step costs more than a decode step (k + 1
    tokens a sequence, and with `overlap_steps` the read it waits for); a step that does not draft is a plain
    decode step. 0: every step drafts where lookup finds a match. tandem's engine only: the vLLM backend drafts
    wherever lookup finds a match."""

    draft_model: str | None = None
    """`draft_model`: the draft's folder (or hub name); its vocabulary must be the policy's. It keeps its
    weights when the policy's change, so its acceptance falls as training moves the policy."""

    draft_sampling: Literal["greedy", "sampled"] = "greedy"
    """`draft_model` and `mtp`: `greedy` drafts the draft's most likely tokens and accepts those the policy's own seeded
    sample equals, so a seed gives the same tokens with speculation on or off; `sampled` drafts at the
    request's temperature and accepts by rejection sampling (more tokens accepted at high temperature, the
    same distribution, but other tokens for a given seed than without speculation)."""

    @model_validator(mode="after")
    def _draft_model_named(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("`engine.speculative.method` = 'draft_model' needs `engine.speculative.draft_model`: the "
                             "draft's folder")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError(f"`engine.speculative.draft_model` is set but `engine.speculative.method` = "
                             f"{self.method!r}: set the method to 'draft_model' or remove the folder")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class EngineConfig(Section):
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`. The dtype is `model.dtype`."""

    max_num_seqs: int = Field(64, ge=1)
    """Most sequences in one engine step; more requests wait their turn."""

    max_num_batched_tokens: int = Field(4096, ge=1)
    """Token budget of one engine step: one per decoding sequence plus prefill chunks (long prompts are split)."""

    block_size: int = Field(16, ge=1)
    """Tokens per KV-cache block."""

    num_blocks: int | None = Field(None, ge=1)
    """KV-cache blocks; unset: what `memory_fraction` (CUDA) or `cpu_kv_cache_gib` (CPU) holds, at most
    `max_num_seqs` sequences of `max_model_len`."""

    memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """CUDA: fraction of the GPU's memory the engine may fill (weights, activations, KV cache). The KV cache takes
    what is left of it after all the GPU holds when the engine starts: with `lora.share_base` that includes the
    trainer, which starts first, and its base, which the engine reads."""

    cpu_kv_cache_gib: float = Field(1.0, gt=0.0)
    """CPU: KV-cache size in GiB when `num_blocks` is unset."""

    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence, prompt plus completion; unset = the model's `max_position_embeddings`."""

    compile_norms: bool = True
    """CUDA: the RMS norms the model calls as modules (the final norm; a block's norms are functions of
    its forward, see `fused_blocks`) as one kernel each with `torch.compile` (a few seconds at startup)."""

    fused_blocks: bool = True
    """CUDA, native models: run each decoder block's pointwise work around attention as Triton kernels
    (input norm; q/k norms, RoPE and the KV-cache write in one launch; residual add and post norm;
    silu(gate) * up) and q/k/v and gate/up as one matmul each (`inference/engine/fused_blocks.py`).
    Off in `[run] exact`. Fewer launches and passes over memory make decode steps shorter; logprobs differ
    from the trainer's a little more, as the sums run in another order
    (`benchmarks/results/engine-h200-2026-12-04-fused-blocks.json` against
    `benchmarks/results/engine-h200-2026-12-04-unfused.json`; a mixture of experts:
    `benchmarks/results/engine-moe-h200-2026-12-04-fused-blocks.json`)."""

    cuda_graphs: bool = True
    """CUDA: replay decode-only steps from CUDA graphs captured at startup for batch sizes 1, 2, 4, 8,
    16, 32, ... up to `max_num_seqs`, each for a few bounds of the longest context (512, 2048, 8192, ...
    `max_model_len`; a few seconds and a little memory: each graph keeps its logits, batch x vocabulary);
    with `speculative`, steps that verify drafts too (a graph per batch size, k + 1 tokens a sequence); prefill
    steps run eager. Latent-attention models (GLM-5, DeepSeek-V3) replay decode-only steps where their Triton
    kernels serve (steps that verify drafts, and `speculative.method` = `mtp`, run eager)."""

    moe_tile_table: str | None = None
    """CUDA, mixtures of experts: a JSON table of the expert matmuls' tiles by token count, written by
    `benchmarks/moe_tune.py` on this GPU; unset: the table shipped for this GPU
    (`tandem/kernels/moe_tile_tables/<GPU name>.json`) where there is one. A forward takes the entry of
    the smallest tuned token count that holds it; expert shapes a table lacks get tiles from a rule of
    the rows per expert."""

    overlap_steps: bool = True
    """CUDA, native models: schedule and launch each step before reading the previous step's tokens,
    so the host's work runs while the GPU computes. A sequence that stops at EOS or a stop string
    computes one more token, which is dropped. (On CPU all work is the host's: nothing to overlap.)"""

    num_step_records: int = Field(0, ge=0)
    """Keep a record of each of the last this many engine steps, served by `GET /engine/steps`: when its tokens came
    out, how the time since the previous step's split (the engine thread's host work, its wait for the device,
    admitting prompts handed over by a prefill server, garbage collection) and what the step held (its batch, prompt
    tokens, handed-over prompts joining it and their KV tokens written in, whether a CUDA graph replayed it). For
    telling what makes slow steps slow (`benchmarks/disaggregated.py`); a few clock reads a step, no device sync.
    0: off."""

    quantization: Literal["none", "fp8"] = "none"
    """`fp8`, native models: each block's dense projections (q/k/v/o, or latent attention's q_a/q_b/kv_a/o and DSA
    indexer's wq_b/wk; gate/up/down of a dense feed-forward or of shared experts; the routed experts with
    `fp8_experts`) in block-scaled FP8, weights in 128 x 128 blocks,
    activations quantized per token and 128 columns (`tandem.kernels.fp8`; the experts: `tandem.kernels.moe`):
    half the weight memory of bf16, and FP8 tensor cores (CUDA: compute capability 8.9
    or newer; the CPU runs a slow torch reference of the same scheme). An FP8 checkpoint (`quantization_config`
    of `quant_method` "fp8", 128 x 128 blocks) loads as it is; bf16 weights, at start and in every update, are
    quantized on load. Embeddings, norms, the LM head and routers keep `model.dtype`. `none`: every
    weight in `model.dtype` (an FP8 checkpoint is dequantized). Not with `[run] exact`. The vLLM backend maps it
    to vLLM's own block FP8 (docs/vllm.md)."""

    fp8_tile_table: str | None = None
    """CUDA, `quantization` = "fp8": a JSON table of the dense FP8 products' implementation and tiles by token count
    (the Triton kernel's tiles, or cuBLAS's block-scaled `torch._scaled_mm` where it is faster), written by
    `benchmarks/fp8_matmul.py --table-out` on this GPU; unset: the table shipped for this GPU
    (`tandem/kernels/fp8_tile_tables/<GPU name>.json`) where there is one. A product takes the entry of the smallest
    tuned token count that holds it; weight shapes a table lacks get the Triton kernel with tiles from a rule of the
    token count."""

    fp8_experts: bool = True
    """With `quantization` = "fp8", a mixture of experts' routed experts in block FP8 too (the fused MoE kernel in FP8:
    `tandem.kernels.moe`): on such models they are most of the weights a decode step reads. Off, they stay in
    `model.dtype` (an FP8 checkpoint's experts are dequantized) and only the other projections are FP8. `tandem rl`
    passes it to the trainer's broadcast (`weight_transport.fp8_experts`)."""

    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """`auto`: the KV cache holds keys and values in `model.dtype`. `fp8`, native models of decoder blocks: in
    float8_e4m3fn, each token's head with an fp32 scale of its own fitted when it is written
    (`tandem/inference/engine/kv_cache.py`), so the scales follow the weights as RL moves them: at head_dim 128
    the cache holds 1.94x the tokens of bf16 in the same memory, and a decode step reads half the bytes per
    token of context. Latent attention (GLM-5, DeepSeek-V3): each entry's latent part and each DSA indexer key in
    FP8 with a scale per token, the RoPE part in `model.dtype` (it carries the position): about 1.8x the tokens at
    GLM-5's shape. The CPU dequantizes (slow, for tests); CUDA needs compute capability 8.9 or newer. Not with
    `[run] exact`; with the vLLM backend it becomes vLLM's `--kv-cache-dtype fp8`."""

    cascade_attention: Literal["auto", "on", "off"] = "auto"
    """`auto`, native models of decoder blocks on CUDA (where its kernels run): in a decode step, sequences that
    share a prompt prefix (the n samples of a prompt, whose prefix-cached blocks are the same) read its keys and
    values once for the whole group, not once each, when the step saves at least `cascade_min_saved_tokens`
    (`docs/inference.md`, "Shared prompts read once"). Outputs equal plain attention's within rounding (the sums
    run in another order). Off in `[run] exact` (not batch invariant); latent-attention models never take it. With
    `cuda_graphs` each graph is captured a second time for it.
    `on`: on every device, for tests and comparisons: on the CPU the cascade's torch path, which gathers each
    group's prefix apart, costs more than plain attention, which is why `auto` leaves it off there.
    `off`: plain decode attention."""

    cascade_min_saved_tokens: int = Field(2048, ge=1)
    """`cascade_attention` = `auto` or `on`: the fewest tokens of keys and values per layer that a decode step's groups
    must spare (each group: its members but one times its prefix) for it to read shared prefixes once. Below it the
    two extra launches per layer are expected to cost more than the bytes spared: 2048 tokens of Qwen3's 8 KV heads
    of 128 in bf16 are 8 MB per layer, a few microseconds of reading, about what two launches cost
    (`benchmarks/cascade_attention.py` measures where the cascade stops paying)."""

    lora: LoraConfig = LoraConfig()
    """The policy is the base model plus LoRA adapters, which weight updates send alone: the engine keeps a host
    copy of the targeted base weights and merges each update's adapters into them
    (`tandem.inference.engine.lora_merge`). `tandem rl` copies the trainer's `lora` here."""

    speculative: SpeculativeConfig = SpeculativeConfig()
    """Speculative decoding (off by default). A draft model or MTP drafts need `overlap_steps` = false on CUDA; n-gram
    drafts overlap the steps that do not draft. With `[run] exact` the
    verifying forward computes each token as a decode step would, so the logprobs stay the trainer's bit for bit.
    With prefill/decode disaggregation a decode server speculates as a colocated server does (a draft model
    prefills a handed prompt itself); `mtp` needs its prefill servers to set the same method, which then write
    the layer's entries into the blocks they hand over (`tandem rl` gives every server the same `engine`).
    The vLLM backend gets the same drafts as its `--speculative-config` (`docs/vllm.md`)."""


class DisaggregationConfig(Section):
    """Prefill/decode disaggregation (`tandem/inference/disaggregated/`): prefill servers compute long prompts, decode
    servers generate, and a prompt's KV cache moves from the first to the second. Clients (the orchestrator) talk to
    decode servers only. `tandem rl` sets every key of each server from `deployment.num_prefill_servers` and
    `deployment.num_decode_servers`; set them yourself only for a lone `tandem inference`."""

    role: Literal["colocated", "prefill", "decode"] = "colocated"
    """`colocated`: one server prefills and decodes (the default). `prefill`: computes prompts for decode servers
    (`POST /prefill`) and serves the API as any server. `decode`: hands long prompts to `prefill_urls`. Either
    role takes `engine.speculative`; with `mtp` a decode server's prefill servers need it too (their blocks carry
    the layer's entries: a decode server refuses, at start-up, a prefill server whose blocks do not)."""

    prefill_urls: list[str] = []
    """`decode`: base URLs of the prefill servers; each must answer at start-up, else the server exits naming it."""

    min_remote_prefill_tokens: int = Field(512, ge=1)
    """`decode`: a prompt goes to a prefill server when at least this many of its tokens are not in this server's
    prefix cache; a turn's few new tokens after a cached conversation are computed here, where the hand-off would
    cost more than they do."""

    kv_transport: Literal["http", "torch_distributed", "shared_memory"] = "http"
    """`decode`: how the KV blocks come over. `http`: in the body of a response (any two hosts). `torch_distributed`:
    a torch.distributed pair group with each prefill server, joined at start-up (gloo on the CPU, NCCL on CUDA).
    `shared_memory`: one host only; a staging area in each prefill server that this server maps at start-up (CUDA
    IPC on a GPU, /dev/shm on the CPU) and copies the blocks out of, so no byte crosses a socket."""

    staging_mib: float = Field(512.0, gt=0)
    """`prefill`, for decode servers with `kv_transport` = 'shared_memory': the staging area each of them gets, in
    MiB, on this server's device (beside `engine.memory_fraction`'s share). A prompt's blocks larger than it cross
    in several pieces, each a round trip."""

    forward_updates_to: list[str] = []
    """`decode`: prefill servers this server passes each weight update on to, so that both pools load every policy
    (`tandem rl` gives each prefill server to one decode server)."""

    peer_timeout_s: float = Field(30.0, gt=0)
    """`decode`: longest wait for a prefill server, at start-up and for one prompt (its compute and its KV); past it
    the prompt is prefilled here."""

    peer_retry_s: float = Field(5.0, ge=0)
    """`decode`: after a failure, a prefill server gets no prompts for this long (they are prefilled here)."""

    hold_timeout_s: float = Field(60.0, gt=0)
    """`prefill`: how long a computed prompt's KV waits for its decode server to take it before it is dropped."""

    max_held_mib: float | None = Field(None, gt=0)
    """`prefill`: the most MiB of computed prompts' KV this server holds for decode servers to take, counting the
    prompts it is computing at their estimated size. A `POST /prefill` that would pass it is refused (429) before any
    work, and its decode server asks again after a pause (within `peer_timeout_s`, then it prefills the prompt
    itself); one whose KV alone passes it is refused for good (400). None: the size of this server's KV cache, so
    the prompts waiting add at most one cache's worth of device memory beside it (outside `engine.memory_fraction`'s
    share)."""

    max_received_mib: float | None = Field(None, gt=0)
    """`decode`: the most MiB of handed prompts' KV this server holds before its engine takes them in (they wait for
    room in its batch and cache), counting the prompts being fetched at their estimated size; past it a prompt
    waits, its tokens only, to be asked for, and one whose KV alone passes it is prefilled here. None: the size of
    this server's KV cache."""

    @model_validator(mode="after")
    def _check_peers(self) -> "DisaggregationConfig":
        if self.role == "decode" and not self.prefill_urls:
            raise ValueError("`role` = 'decode' needs `prefill_urls`: the base URL of at least one prefill server")
        if self.role != "decode" and (self.prefill_urls or self.forward_updates_to):
            raise ValueError(f"`prefill_urls` and `forward_updates_to` belong to `role` = 'decode', not {self.role!r}")
        unknown = [url for url in self.forward_updates_to if url not in self.prefill_urls]
        if unknown:
            raise ValueError(f"`forward_updates_to` names {unknown}, which `prefill_urls` does not list")
        return self


class InferenceConfig(ProcessConfig):
    """Root config of the inference server."""

    backend: Literal["tandem", "vllm"] = "tandem"
    """`tandem`: the embedded engine (CPU and CUDA). `vllm`: vLLM's server (scale-out, CUDA only)."""

    server: ServerConfig = ServerConfig()
    """HTTP server settings."""

    engine: EngineConfig = EngineConfig()
    """Settings of tandem's own engine (backend `tandem`); `memory_fraction`, `max_model_len` and
    `max_num_seqs` apply to vLLM too."""

    vllm: VllmConfig = VllmConfig()
    """Settings of the vLLM backend only."""

    disaggregation: DisaggregationConfig = DisaggregationConfig()
    """Prefill/decode disaggregation: this server's role and peers (off by default)."""

    @property
    def num_ranks(self) -> int:
        """Devices (and broadcast-group ranks) of one server: tandem's engine runs on one."""
        return self.vllm.tensor_parallel_size if self.backend == "vllm" else 1

    @model_validator(mode="after")
    def _check_vllm_reads_the_weights(self) -> "InferenceConfig":
        if self.backend == "vllm" and self.model.load_format == "dummy":
            raise ValueError("`model.load_format` = 'dummy' with `backend` = 'vllm': vLLM's random weights are not the ones "
                             "tandem's trainer makes (`tandem.models.random_init`); write the weights "
                             "(`tandem model init` without --config-only) and keep 'safetensors'")
        return self

    @model_validator(mode="after")
    def _check_lora_can_be_served(self) -> "InferenceConfig":
        if not self.engine.lora.enabled:
            if self.server.base_model_name is not None:
                raise ValueError("`server.base_model_name` is set but `engine.lora.enabled` is false: the base model "
                                 "is served apart from the policy only in a LoRA run")
            return self
        if self.backend == "vllm" and self.engine.lora.target_experts:
            raise ValueError(f"`engine.lora.target_experts` = {self.engine.lora.target_experts} with `backend` = 'vllm': "
                             "vLLM 0.26 reads PEFT's adapters of stacked experts correctly only for models it holds as "
                             "3-D expert weights, which its Qwen3-MoE, GLM-4.5, MiniMax-M2 and DeepSeek-V3 are not; "
                             "use `backend` = 'tandem' or leave `lora.target_experts` empty")
        if self.backend == "tandem" and self.server.base_model_name is not None and self._base_refused_by:
            raise ValueError(f"`server.base_model_name` with {self._base_refused_by}: tandem's engine serves the base "
                             "model beside the policy by a side path in its forwards, which exact mode's kernels, "
                             "speculative decoding, prefill/decode disaggregation and the routed experts' grouped "
                             "matmuls do not take; remove one of them")
        if self.engine.quantization != "none":
            raise ValueError(f"`engine.lora.enabled` with `engine.quantization` = {self.engine.quantization!r}: adapters are "
                             "merged into the base's weights in `model.dtype`, which FP8 projections do not hold; set one off")
        return self

    @model_validator(mode="after")
    def _check_base_can_be_mapped(self) -> "InferenceConfig":
        refused = self._shared_base_refused_by
        if self.engine.lora.share_base and refused:
            raise ValueError(f"`engine.lora.share_base` with {refused}: the engine serves a mapped base plus the "
                             "adapters' low-rank products only on its own backend's colocated, non-speculative and "
                             "non-exact path; set one of them off")
        return self

    @property
    def _shared_base_refused_by(self) -> str | None:
        """The setting under which tandem's engine cannot serve the policy from the trainer's base, if any: vLLM (its
        own weights), or one that rules out the side path (`_side_path_refused_by`)."""
        if self.backend != "tandem":
            return f"`backend` = {self.backend!r}"
        return self._side_path_refused_by

    @property
    def _side_path_refused_by(self) -> str | None:
        """The setting under which tandem's engine runs no low-rank side path, if any: exact mode (its batch-invariant
        kernels know none), speculative decoding (drafts verified by the policy) and disaggregation (a prefill
        server's KV is the policy's)."""
        if self.run.exact:
            return "`run.exact`"
        if self.engine.speculative.enabled:
            return "`engine.speculative`"
        if self.disaggregation.role != "colocated":
            return f"`disaggregation.role` = {self.disaggregation.role!r}"
        return None

    @property
    def base_served_name(self) -> str:
        """The name the base model is served under in a LoRA run (`server.base_model_name`)."""
        return self.server.base_model_name or f"{self.model.name}-base"

    @property
    def _base_refused_by(self) -> str | None:
        """The setting under which tandem's engine cannot compute base rows beside the policy's, if any: adapters on
        the routed experts (their grouped matmuls take no side path), or `_side_path_refused_by`."""
        if self.engine.lora.target_experts:
            return "`engine.lora.target_experts`"
        return self._side_path_refused_by

    @property
    def base_serving(self) -> BaseServing:
        """Whether tandem's engine serves the base model beside the LoRA policy: `required` when
        `server.base_model_name` is set, else `where_possible` (where the model takes the side path); `off` without
        LoRA or where a setting rules it out (`_base_refused_by`)."""
        if not self.engine.lora.enabled or self._base_refused_by:
            return "off"
        return "required" if self.server.base_model_name is not None else "where_possible"

    @model_validator(mode="after")
    def _check_disaggregation_can_hold(self) -> "InferenceConfig":
        role = self.disaggregation.role
        if role != "colocated" and self.backend != "tandem":
            raise ValueError(f"`disaggregation.role` = {role!r} needs `backend` = 'tandem': the KV hand-off is tandem's "
                             "engine's")
        return self

    @model_validator(mode="after")
    def _check_cache_fits_a_sequence(self) -> "InferenceConfig":
        e = self.engine
        if e.num_blocks is not None and e.max_model_len is not None and e.num_blocks * e.block_size < e.max_model_len:
            raise ValueError(
                f"`engine.num_blocks` * `engine.block_size` = {e.num_blocks * e.block_size} tokens cannot hold one "
                f"sequence of `engine.max_model_len` = {e.max_model_len}; raise `engine.num_blocks` or lower `engine.max_model_len`"
            )
        return self
