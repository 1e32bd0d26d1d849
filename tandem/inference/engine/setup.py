"""Build an `LLMEngine` from the config: device, model, tokenizer, KV-cache size, runner.

Native models get a paged cache: decoder blocks (Qwen3, Qwen3-MoE, GLM-4.5, MiniMax-M2) the `KVCache` of keys and
values, the latent-attention families (GLM-5, DeepSeek-V3) the `LatentCache` of latent entries and DSA indexer keys;
any other architecture (loaded through transformers) runs on the recompute path. On CUDA the cache takes what
`memory_fraction` leaves after the weights and the activations of a full-budget warmup step. A draft model
(speculative decoding) gets a paged cache of its own with as many blocks as the policy's, sized with it; a
multi-token prediction draft (the policy's own MTP layer, or a decoder family's draft head) keeps its entries as
extra layers of the policy's cache; the policy's MTP layers are built and read only then (`keep_mtp`). Beside a
LoRA policy the base model is served through a low-rank side path (`lora_side_path.py`) where every adapted
projection takes it (native decoder blocks and dense feed-forwards). Over the trainer's shared base
(`lora.share_base`, `mapped_base.py`) the model's weights are mapped, not loaded, and the same side path adds the
adapters to the policy's rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import BaseServing, EngineConfig, SpeculativeConfig
from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.cascade import CascadePlanner
from tandem.inference.engine.fp8_blocks import apply_fp8_blocks, check_fp8_device
from tandem.inference.engine.fused_blocks import apply_fused_blocks
from tandem.inference.engine.fused_moe import RoutingRecorder, apply_fused_moe, moe_blocks
from tandem.inference.engine.fused_norms import apply_compiled_norms
from tandem.inference.engine.kv_cache import KVCache, LatentCache
from tandem.inference.engine.llm_engine import LLMEngine
from tandem.inference.engine.lora_merge import AdapterMerger
from tandem.inference.engine.lora_side_path import LowRankSidePath, apply_side_path, uncovered_projections
from tandem.inference.engine.model_runner import PagedModelRunner, RecomputeModelRunner
from tandem.inference.engine.paged_latent_attention import kernels_serve
from tandem.kernels.cascade_attention import members_per_group
from tandem.models.exact import apply_exact, check_exact, model_uses_kernels
from tandem.inference.engine.sampler import Sampler
from tandem.inference.engine.scheduler import Scheduler
from tandem.inference.engine.speculative import DraftModelProposer, MtpProposer, NgramProposer, Speculator
from tandem.inference.engine.step_records import StepRecords
from tandem.models.hub import resolve_model_path
from tandem.models.glm_moe_dsa import LatentMoeArgs
from tandem.inference.engine.mapped_base import SidePathAdapters, load_mapped_model
from tandem.models.loading import is_native, load_causal_lm, resolve_dtype
from tandem.models.lora import LoraSpec, adapted_parameters, targeted_linears
from tandem.models.multi_token import mtp_layers

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`engine.device` = {name!r} but CUDA is not available here; use `cpu` or `auto`")
    return device


def eos_token_ids(folder: Path, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS plus every `eos_token_id` of generation_config.json (Qwen lists two)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def resolve_max_model_len(engine: EngineConfig, hf_config: dict) -> int:
    limit = hf_config.get("max_position_embeddings")
    if engine.max_model_len is None:
        if limit is None:
            raise ValueError("the model's config.json has no `max_position_embeddings`: set `engine.max_model_len`")
        return int(limit)
    if limit is not None and engine.max_model_len > limit:
        raise ValueError(f"`engine.max_model_len` = {engine.max_model_len} exceeds the model's max_position_embeddings = {limit}")
    return engine.max_model_len


def plan_num_blocks(engine: EngineConfig, model: torch.nn.Module, device: torch.device, bytes_per_block: int, max_model_len: int) -> int:
    """`engine.num_blocks` if set; else what the memory budget holds, at most what a full batch can use."""
    if engine.num_blocks is not None:
        return engine.num_blocks
    useful = engine.max_num_seqs * -(-max_model_len // engine.block_size)  # max_num_seqs sequences at max_model_len
    if device.type != "cuda":
        return min(useful, max(1, int(engine.cpu_kv_cache_gib * 2**30) // bytes_per_block))
    # Peak activations of the largest step, measured with a causal prefill of the full token budget.
    num_tokens = min(engine.max_num_batched_tokens, max_model_len)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what loading freed (random weights' fp32 draws) is not in use: the budget counts only what is
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
        hidden = model(ids, torch.arange(num_tokens, device=device)[None])
        model.lm_head(hidden[0, -engine.max_num_seqs:]).float().softmax(-1)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    budget = int(total * engine.memory_fraction) - (total - free) - activations
    del hidden
    torch.cuda.empty_cache()
    return min(useful, max(0, budget // bytes_per_block))


def build_engine(model_config: ModelConfig, engine: EngineConfig, seed: int, exact: bool = False,
                 base: BaseServing = "off", shared_base: Path | None = None) -> LLMEngine:
    """`exact`: batch-invariant computation (`[run] exact`, `tandem.models.exact`). `base`: serve the base model
    beside a LoRA policy (`InferenceConfig.base_serving`): where the model can take the side path, or
    `required` (an error where it cannot). `shared_base`: with `engine.lora.share_base`, the trainer's
    `shared_base.json`, whose tensors are the model's weights (`mapped_base.py`)."""
    device = resolve_device(engine.device)
    fp8 = engine.quantization == "fp8"
    if fp8:
        if exact:
            raise ValueError("`engine.quantization` = 'fp8' cannot run exact: FP8 products cannot equal the trainer's bit for bit")
        check_fp8_device(device)
    fp8_cache = engine.kv_cache_dtype == "fp8"
    if fp8_cache:
        if exact:
            raise ValueError("`engine.kv_cache_dtype` = 'fp8' cannot run exact: attention over an FP8 cache (keys and "
                             "values, or latent entries) cannot equal the trainer's bit for bit")
        check_fp8_device(device, "engine.kv_cache_dtype", "auto")
    folder = resolve_model_path(model_config.name)
    lora = engine.lora
    shared = lora.enabled and lora.share_base
    if shared:
        if shared_base is None or not Path(shared_base).is_file():
            raise FileNotFoundError(f"`engine.lora.share_base` maps the trainer's base, described in its run folder's "
                                    f"shared_base.json, which is missing ({shared_base}): start the trainer first")
        model = load_mapped_model(folder, Path(shared_base), device, resolve_dtype(model_config.dtype, device))
    else:
        # The model's MTP layers only where it drafts with them: nothing else reads them.
        model = load_causal_lm(str(folder), device, model_config.dtype, model_config.trust_remote_code,
                               model_config.load_format, engine.quantization, engine.fp8_experts,
                               keep_mtp=engine.speculative.method == "mtp")
    # The engine never trains: no weight asks for autograd, so the compiled functions' guards see one flag for all
    # (the MTP layers' would otherwise differ from the trunk's, a recompile each call past dynamo's limit).
    model.requires_grad_(False)
    if fp8:  # before anything runs the model: its own forward cannot multiply by FP8 layers
        apply_fp8_blocks(model, kernels=engine.fused_blocks, tile_table=engine.fp8_tile_table,
                         max_tokens=max(engine.max_num_batched_tokens, engine.max_num_seqs))
    if exact:
        check_exact(model.hf_config, str(folder / "config.json"))
        apply_exact(model, stack=True)  # the engine: its projections stacked once
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=model_config.trust_remote_code)
    max_model_len = resolve_max_model_len(engine, model.hf_config)
    spec = engine.speculative
    draft = None
    if spec.method == "draft_model":
        draft = load_draft_model(spec, model_config, device, folder, tokenizer, model.hf_config.get("vocab_size"),
                                 max_model_len)
    mtp = spec.method == "mtp"
    if mtp:
        check_mtp_layers(model, model_config)
    if is_native(model.hf_config):
        per_block = cache_bytes_per_block(model, engine.block_size, fp8_cache, mtp)
        if draft is not None:
            per_block += cache_bytes_per_block(draft, engine.block_size, fp8_cache)
        num_blocks = plan_num_blocks(engine, model, device, per_block, max_model_len)
        check_cache_fits(num_blocks, engine.block_size, max_model_len)
        cache = cache_for(model, num_blocks, engine.block_size, device, fp8_cache, mtp)
        if engine.compile_norms and device.type == "cuda" and not exact:  # exact: its own norms (`tandem.models.exact`)
            apply_compiled_norms(model)
        policy_path = policy_side_path(model, engine, device) if shared else None
        base_path = (policy_path if base != "off" else None) if shared else side_path_for_base(model, engine, device, base)
        side = policy_path or base_path
        fused = engine.fused_blocks and device.type == "cuda" and not (exact or fp8)  # exact, fp8: their own blocks
        if fused:
            apply_fused_blocks(model, side)
        if side is not None:
            apply_side_path(model, side, blocks=not fused)
        recorder = moe_routing_recorder(model, engine, device, kernels=not exact)
        # The latent cache's torch path gathers whole contexts (a graph would keep its largest bound's for good); its
        # kernels read the cache in place. MTP drafting keeps each step's forward, which a replay does not make. Exact
        # mode captures only forwards wholly on its kernel path: latent blocks run eager (torch, token by token).
        in_place = not isinstance(cache, LatentCache) or kernels_serve(cache, model.args.kv_lora_rank)
        graphs = engine.cuda_graphs and in_place and not mtp and (not exact or model_uses_kernels(model, device))
        cascade = None
        cascade_serves = engine.cascade_attention == "on" or (engine.cascade_attention == "auto" and device.type == "cuda")
        if cascade_serves and not exact and isinstance(cache, KVCache):
            members = members_per_group(model.hf_config["num_attention_heads"], cache.keys.shape[3])
            cascade = CascadePlanner(engine.block_size, members, engine.cascade_min_saved_tokens)
        runner = PagedModelRunner(model, cache, device, engine.max_num_seqs, max_model_len, graphs, recorder, exact,
                                  side, keep_forward=mtp, cascade=cascade,
                                  num_draft_tokens=spec.num_tokens if spec.enabled else 0)
        overlap = engine.overlap_steps and device.type == "cuda"
        weight_target = model
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s) on %s", num_blocks, engine.block_size,
                 num_blocks * per_block / 2**30, "fp8" if fp8_cache else cache.dtype, device)
    else:
        if fp8_cache:
            raise ValueError(f"`engine.kv_cache_dtype` = 'fp8': {model.hf_config.get('model_type')!r} runs on the recompute "
                             "path, which keeps no KV cache to store in FP8; set `engine.kv_cache_dtype` = 'auto'")
        # No cache tensor on the recompute path; blocks still bound how many tokens run at once.
        num_blocks = engine.num_blocks or engine.max_num_seqs * -(-max_model_len // engine.block_size)
        check_cache_fits(num_blocks, engine.block_size, max_model_len)
        runner = RecomputeModelRunner(model, device)
        base_path = policy_path = None
        if base == "required":
            raise ValueError(f"`server.base_model_name` is set, but {model.hf_config.get('model_type')!r} runs on the "
                             "recompute path of transformers models, which takes no side path to serve the base model "
                             "beside the LoRA policy; remove `server.base_model_name`")
        overlap = False
        weight_target = model.hf_model
        log.info("%s: not native to tandem, a transformers model recomputed every step (slow path)",
                 model.hf_config.get("model_type"))
    if spec.method in ("draft_model", "mtp") and overlap:
        raise ValueError(f"`engine.speculative.method` = {spec.method!r} with `engine.overlap_steps` = true on CUDA: "
                         "this draft runs beside every step of the policy, and no step of it can be launched before "
                         "the previous one is read; set `engine.overlap_steps` = false (n-gram drafts overlap the "
                         "steps that do not draft)")
    block_manager = BlockManager(num_blocks, engine.block_size)
    lora_spec = LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules), tuple(lora.target_experts))
    if policy_path is not None:
        adapted = adapted_parameters(model, lora_spec, "the engine's config", "engine.lora")
        adapters = SidePathAdapters(policy_path, lora_spec, {name: param.shape for name, param in adapted.items()})
    else:
        adapters = AdapterMerger(weight_target, lora_spec, base_path=base_path) if lora.enabled else None
    sampler = Sampler(device, seed, exact)
    speculator = None
    if spec.method == "ngram":
        speculator = Speculator(NgramProposer(spec.ngram_max, spec.min_expected_tokens), sampler)
    elif draft is not None:
        draft_runner = PagedModelRunner(draft, cache_for(draft, num_blocks, engine.block_size, device, fp8_cache), device,
                                        engine.max_num_seqs, max_model_len, cuda_graphs=False)
        speculator = Speculator(DraftModelProposer(draft_runner, sampler, spec.draft_sampling == "sampled",
                                                   engine.max_num_batched_tokens), sampler)
    elif mtp:
        speculator = Speculator(MtpProposer(runner, sampler, spec.draft_sampling == "sampled", engine.max_num_seqs), sampler)
    return LLMEngine(
        runner=runner,
        weight_target=weight_target,
        tokenizer=tokenizer,
        block_manager=block_manager,
        scheduler=Scheduler(block_manager, engine.max_num_seqs, engine.max_num_batched_tokens,
                            spec.num_tokens if spec.enabled else 0),
        sampler=sampler,
        eos_token_ids=eos_token_ids(folder, tokenizer),
        max_model_len=max_model_len,
        vocab_size=model.lm_head.weight.shape[0],
        device=device,
        overlap=overlap,
        adapters=adapters,
        speculator=speculator,
        base_path=base_path,
        step_records=StepRecords(engine.num_step_records, device) if engine.num_step_records else None,
    )


def policy_side_path(model: torch.nn.Module, engine: EngineConfig, device: torch.device) -> LowRankSidePath:
    """Over a shared base (`engine.lora.share_base`): the side path that adds the adapters to the policy's rows,
    refused (naming the key) where an adapted projection is one it does not reach."""
    spec = LoraSpec(engine.lora.rank, engine.lora.alpha, tuple(engine.lora.target_modules))
    linears = targeted_linears(model, spec.target_modules)
    uncovered = uncovered_projections(model, linears)
    if uncovered:
        raise ValueError(f"`engine.lora.share_base`: the low-rank side path that serves the policy over the trainer's "
                         f"base does not reach the adapted projections {uncovered[:4]} of this "
                         f"{model.hf_config.get('model_type')!r} model (latent attention); set `lora.share_base` = false")
    return LowRankSidePath(linears, spec.scale, 1.0, spec.rank, device, model.lm_head.weight.dtype)


def side_path_for_base(model: torch.nn.Module, engine: EngineConfig, device: torch.device,
                       base: BaseServing) -> LowRankSidePath | None:
    """The side path that serves the base model beside the LoRA policy (`lora_side_path.py`), or None: not asked,
    or (unless `required`, then an error naming the key) a model whose adapted projections it does not reach."""
    if base == "off" or not engine.lora.enabled:
        return None
    spec = LoraSpec(engine.lora.rank, engine.lora.alpha, tuple(engine.lora.target_modules))
    linears = targeted_linears(model, spec.target_modules)
    uncovered = uncovered_projections(model, linears)
    if uncovered:
        reason = (f"the side path that serves the base model does not reach the adapted projections {uncovered[:4]} of "
                  f"this {model.hf_config.get('model_type')!r} model (latent attention, routed experts)")
        if base == "required":
            raise ValueError(f"`server.base_model_name` is set, but {reason}; remove `server.base_model_name` or adapt "
                             "other projections (`engine.lora.target_modules`)")
        log.warning("the base model is not served beside the LoRA policy: %s", reason)
        return None
    return LowRankSidePath(linears, spec.scale, -1.0, spec.rank, device, model.lm_head.weight.dtype)


def cache_layout(model: torch.nn.Module, fp8: bool = False, mtp: bool = False
                 ) -> tuple[type[KVCache] | type[LatentCache], dict[str, Any]]:
    """The cache class a native model needs and the sizes it is built with (besides blocks, dtype and device);
    `fp8`: held in FP8 with scales fitted per token (`engine.kv_cache_dtype`; `KVCache`: keys and values, a scale
    per token and head; `LatentCache`: latent parts and indexer keys, a scale per token, RoPE parts as they are);
    `mtp`: room for the multi-token prediction layers' entries too, as the layers after the blocks (their
    `layer_idx`)."""
    args = model.args
    num_layers = args.num_hidden_layers + (args.num_nextn_predict_layers if mtp else 0)
    if isinstance(args, LatentMoeArgs):
        indexed = [i for i, kind in enumerate(args.indexer_types) if kind == "full"]
        indexed += list(range(args.num_hidden_layers, num_layers)) if args.has_dsa else []  # each MTP layer indexes
        return LatentCache, dict(num_layers=num_layers, entry_dim=args.kv_lora_rank + args.qk_rope_head_dim,
                                 indexed_layers=indexed, index_dim=args.index_head_dim, fp8=fp8,
                                 rope_dim=args.qk_rope_head_dim)
    return KVCache, dict(num_layers=num_layers, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim, fp8=fp8)


def cache_bytes_per_block(model: torch.nn.Module, block_size: int, fp8: bool = False, mtp: bool = False) -> int:
    cls, sizes = cache_layout(model, fp8, mtp)
    return cls.bytes_per_block(block_size=block_size, dtype=model.lm_head.weight.dtype, **sizes)


def cache_for(model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
              fp8: bool = False, mtp: bool = False) -> KVCache | LatentCache:
    cls, sizes = cache_layout(model, fp8, mtp)
    return cls(num_blocks=num_blocks, block_size=block_size, dtype=model.lm_head.weight.dtype, device=device, **sizes)


def check_mtp_layers(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """`engine.speculative.method` = 'mtp' drafts with the policy's multi-token prediction layer: refused for a model
    that has none (a checkpoint without `num_nextn_predict_layers`, a family that keeps none)."""
    if not mtp_layers(model):
        raise ValueError(f"`engine.speculative.method` = 'mtp', but `model.name` = {model_config.name!r} "
                         f"({model.hf_config.get('model_type')!r}) has no multi-token prediction layer tandem runs "
                         "(`num_nextn_predict_layers` = 0, or a family that keeps none; GLM-5, DeepSeek-V3 and GLM-4.5 "
                         "checkpoints carry one, `tandem model add-draft-head` gives Qwen3, Qwen3-MoE and MiniMax-M2 "
                         "models one); choose 'ngram' or 'draft_model'")


def load_draft_model(spec: SpeculativeConfig, model_config: ModelConfig, device: torch.device, policy_folder: Path,
                     tokenizer: Any, policy_vocab_size: int, max_model_len: int) -> torch.nn.Module:
    """`engine.speculative.draft_model` on the policy's device and dtype, refused unless it can draft for the policy:
    a native model (it needs a paged cache), the policy's vocabulary, room for `max_model_len`."""
    from transformers import AutoTokenizer

    folder = resolve_model_path(spec.draft_model)
    draft = load_causal_lm(str(folder), device, model_config.dtype, model_config.trust_remote_code, keep_mtp=False)
    draft.requires_grad_(False)
    key = "`engine.speculative.draft_model`"
    if not is_native(draft.hf_config):
        raise ValueError(f"{key} = {str(folder)!r} is a {draft.hf_config.get('model_type')!r} model: a draft needs a "
                         "paged cache, which only tandem's native models have (Qwen3, Qwen3-MoE, GLM-4.5, MiniMax-M2, "
                         "GLM-5, DeepSeek-V3)")
    draft_tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=model_config.trust_remote_code)
    draft_vocab, policy_vocab = draft.hf_config.get("vocab_size"), policy_vocab_size
    if draft_vocab != policy_vocab or draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{key} = {str(folder)!r} (vocab_size {draft_vocab}, a tokenizer of {len(draft_tokenizer)} "
                         f"tokens) does not share the vocabulary of the policy, `model.name` = {str(policy_folder)!r} "
                         f"(vocab_size {policy_vocab}, a tokenizer of {len(tokenizer)} tokens): a draft must have the "
                         "policy's tokenizer and vocabulary")
    limit = draft.hf_config.get("max_position_embeddings")
    if limit is not None and limit < max_model_len:
        raise ValueError(f"{key} = {str(folder)!r} holds {limit} positions (max_position_embeddings), fewer than "
                         f"`engine.max_model_len` = {max_model_len}: lower `engine.max_model_len`")
    return draft


def moe_routing_recorder(model: torch.nn.Module, engine: EngineConfig, device: torch.device,
                         kernels: bool = True) -> RoutingRecorder | None:
    """For a mixture of experts: the engine's MoE kernels installed (CUDA, unless `kernels` is false) and the
    recorder of their routing."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    max_tokens = max(engine.max_num_batched_tokens, engine.max_num_seqs)
    recorder = RoutingRecorder(len(blocks), max_tokens, blocks[0].args.top_k, device)
    apply_fused_moe(model, recorder, kernels, engine.moe_tile_table, max_tokens)
    return recorder


def check_cache_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}), less than one "
            f"sequence of max_model_len = {max_model_len}: lower `engine.max_model_len` or give the cache more memory "
            "(`engine.num_blocks`, `engine.memory_fraction`, `engine.cpu_kv_cache_gib`)"
        )
