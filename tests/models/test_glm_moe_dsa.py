"""GLM-5 (`glm_moe_dsa`) and DeepSeek-V3 (`deepseek_v3`): equal to transformers' classes and to an fp64 reference of
MLA and DSA written from the papers; the multi-token prediction layer kept; bad configs refused; the indexer frozen in
training; the engine's two forms of attention over latent entries (its paged cache: tests/inference/test_latent_cache.py)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_moe import DOCUMENTS, next_token_logprobs, packed_row, write_with_random_biases
from transformers import AutoModelForCausalLM

from tandem.models.layers import rope_cos_sin
from tandem.models.loading import build_native, load_causal_lm
from tandem.models.presets import PRESETS, init_model, preset_config, shape_config, write_model
from tandem.models.weights import load_state_dict

TINY_GLM5 = PRESETS["tiny-glm5"]
TINY_DEEPSEEK_V3 = PRESETS["tiny-deepseek-v3"]
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0,
            beta_fast=32, beta_slow=1)
"""DeepSeek-V3's RoPE scaling: mscale_all_dim scales the attention logits too."""


def theirs_by_document(folder, ids: torch.Tensor) -> torch.Tensor:
    """transformers' next-token logprobs of the packed row, one document per forward (its model takes no packed rows)."""
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert type(theirs).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    out, start = [], 0
    with torch.no_grad():
        for n in DOCUMENTS:
            document = ids[:, start:start + n]
            out.append(next_token_logprobs(theirs(input_ids=document, use_cache=False).logits, document))
            start += n
    return torch.cat(out, dim=1)


def ours_by_document(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Our next-token logprobs of the packed row in one forward, without the pairs that cross documents."""
    with torch.no_grad():
        logprobs = next_token_logprobs(model.lm_head(model(ids, positions)), ids)
    ends = torch.tensor(DOCUMENTS).cumsum(0)[:-1] - 1  # predicting the next document's first token
    return logprobs[:, [t for t in range(logprobs.shape[1]) if t not in ends]]


@pytest.mark.parametrize("index_topk", [64, 4], ids=["topk-past-the-context", "sparse"])
def test_glm5_equals_transformers_on_a_packed_row(index_topk, tmp_path):
    folder = write_with_random_biases(dict(TINY_GLM5, index_topk=index_topk), tmp_path / "m")
    ours = load_causal_lm(str(folder), "cpu", "float32")
    ids, positions = packed_row(ours.args.vocab_size)
    got = ours_by_document(ours, ids, positions)
    torch.testing.assert_close(got, theirs_by_document(folder, ids), atol=1e-5, rtol=0)
    if index_topk < max(DOCUMENTS):  # the sparse path ran: past the first top-k tokens of a document, not dense attention
        ours.args.index_topk = 64
        dense = ours_by_document(ours, ids, positions)
        positions_predicting = torch.cat([torch.arange(n - 1) for n in DOCUMENTS])
        early = positions_predicting < index_topk
        torch.testing.assert_close(got[:, early], dense[:, early], atol=1e-5, rtol=0)
        assert ((got - dense).abs()[:, ~early] > 1e-3).all()


@pytest.mark.parametrize("shape", [
    dict(TINY_DEEPSEEK_V3, rope_parameters=YARN),
    dict(TINY_DEEPSEEK_V3, rope_interleave=False, q_lora_rank=None, attention_bias=True, num_nextn_predict_layers=0),
], ids=["yarn-interleaved", "halves-full-query-biases"])
def test_deepseek_v3_equals_transformers_on_a_packed_row(shape, tmp_path):
    folder = write_with_random_biases(shape, tmp_path / "m")
    ours = load_causal_lm(str(folder), "cpu", "float32")
    assert not ours.args.has_dsa
    ids, positions = packed_row(ours.args.vocab_size)
    torch.testing.assert_close(ours_by_document(ours, ids, positions), theirs_by_document(folder, ids), atol=1e-5, rtol=0)


def rope_pairs(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as DeepSeek's papers and reference code write it: feature pair (2i, 2i+1) of x [T, ..., Dr] is a complex
    number turned by the angle t * theta^(-2i / Dr) at position t."""
    T, Dr = x.shape[0], x.shape[-1]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, Dr, 2, dtype=torch.float64) / Dr)
    turn = torch.polar(torch.ones_like(angles), angles).view(T, *[1] * (x.dim() - 2), Dr // 2)
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], Dr // 2, 2).contiguous()) * turn).flatten(-2)


def reference_attention(w: dict[str, torch.Tensor], x: torch.Tensor, a, selection: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's MLA + DSA in fp64, from the DeepSeek-V2/V3 (MLA), DeepSeek-V3.2 (DSA) and GLM-5 papers: the normed
    input x [T, hidden] of one document -> (the attention's output [T, hidden], the selection [T, T] of the layer's
    indexer, or `selection` for a shared layer). `w`: the layer's `self_attn.*` weights; `a`: the model's args."""
    T, H, Dn, Dr, Dv = x.shape[0], a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim

    def rms(v, g):  # the latents' norms (eps 1e-6)
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    c_q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])  # the query latent
    q = (c_q @ w["q_b_proj.weight"].T).view(T, H, Dn + Dr)
    c_kv, k_rope = (x @ w["kv_a_proj_with_mqa.weight"].T).split((a.kv_lora_rank, Dr), dim=-1)
    k_nope, v = (rms(c_kv, w["kv_a_layernorm.weight"]) @ w["kv_b_proj.weight"].T).view(T, H, Dn + Dv).split((Dn, Dv), -1)
    q = torch.cat((q[..., :Dn], rope_pairs(q[..., Dn:], a.rope_theta)), dim=-1)
    k = torch.cat((k_nope, rope_pairs(k_rope, a.rope_theta)[:, None].expand(T, H, Dr)), dim=-1)
    logits = torch.einsum("thd,shd->hts", q, k) / math.sqrt(Dn + Dr)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if selection is None:  # I[t, s] = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s]), RoPE on the first Dr features
        HI, DI = a.index_n_heads, a.index_head_dim
        q_i = (c_q @ w["indexer.wq_b.weight"].T).view(T, HI, DI)
        q_i = torch.cat((rope_pairs(q_i[..., :Dr], a.rope_theta), q_i[..., Dr:]), dim=-1)
        k_i = F.layer_norm(x @ w["indexer.wk.weight"].T, (DI,), w["indexer.k_norm.weight"], w["indexer.k_norm.bias"], 1e-6)
        k_i = torch.cat((rope_pairs(k_i[..., :Dr], a.rope_theta), k_i[..., Dr:]), dim=-1)
        head_weights = x @ w["indexer.weights_proj.weight"].T / math.sqrt(HI)
        index = torch.einsum("tj,tjs->ts", head_weights, torch.relu(torch.einsum("tjd,sd->tjs", q_i, k_i) / math.sqrt(DI)))
        index = index.masked_fill(~causal, float("-inf"))
        selection = torch.zeros(T, T, dtype=torch.bool)
        for t in range(T):
            ranked = index[t, :t + 1].sort(descending=True).values
            if t + 1 > a.index_topk:  # a tie at the cut would make the choice arbitrary
                assert ranked[a.index_topk - 1] > ranked[a.index_topk] + 1e-9
            selection[t, index[t, :t + 1].topk(min(a.index_topk, t + 1)).indices] = True
    probs = logits.masked_fill(~(causal & selection), float("-inf")).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs, v).reshape(T, H * Dv) @ w["o_proj.weight"].T
    return out, selection


class NoFeedForward(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def test_mla_and_dsa_equal_the_papers_formulas_as_do_transformers(tmp_path):
    """A full layer and the shared layer after it, past top-k (24 tokens, 4 kept), in fp64: ours and transformers'
    attention modules against `reference_attention` (within 1e-7: both compute RoPE's angles in fp32)."""
    folder = write_with_random_biases(dict(TINY_GLM5, index_topk=4), tmp_path / "m")
    ours = load_causal_lm(str(folder), "cpu", "float32").double()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()
    a, T = ours.args, 24
    assert a.indexer_types[:2] == ["full", "shared"]
    state = {k: v.double() for k, v in load_state_dict(folder).items()}
    xs = torch.randn(2, T, a.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T)[None]
    cos, sin = rope_cos_sin(positions, a.rotary_dim, a.rope_theta, torch.float64)
    context = ours.sparse_context(positions)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # transformers' causal mask for SDPA
    their_embeddings = theirs.model.rotary_emb(xs, positions)
    selection = their_topk = expected_selection = None
    with torch.no_grad():
        for i in (0, 1):
            block = ours.layers[i]
            block.mlp = NoFeedForward()
            normed = block.input_layernorm(xs[i])
            expected, expected_selection = reference_attention(
                {k.removeprefix(f"model.layers.{i}.self_attn."): v for k, v in state.items()
                 if k.startswith(f"model.layers.{i}.self_attn.")}, normed, a, None if i == 0 else expected_selection)
            out, selection = block(xs[i][None], cos, sin, None, context, selection)
            torch.testing.assert_close(out[0] - xs[i], expected, atol=1e-7, rtol=0)
            chosen = torch.zeros(T, T, dtype=torch.bool).scatter_(-1, selection.positions[0], selection.kept[0])
            assert torch.equal(chosen, expected_selection)
            attended, _, their_topk = theirs.model.layers[i].self_attn(normed[None], their_embeddings, mask,
                                                                        prev_topk_indices=their_topk)
            torch.testing.assert_close(attended[0], expected, atol=1e-7, rtol=0)
    assert not expected_selection.tril().all()  # queries past the first 4 tokens left some out


@pytest.mark.parametrize("shape", [TINY_GLM5, dict(TINY_DEEPSEEK_V3, rope_parameters=YARN, q_lora_rank=None)],
                         ids=["glm5", "deepseek-v3-yarn-full-query"])
def test_absorbed_and_expanded_forms_equal_the_models_attention(shape, tmp_path):
    """The forms over latent entries (`LatentAttention.attend_expanded` and `attend_absorbed` under a mask,
    `attend_chosen` over each query's positions) against attention of the model's expanded q, k and v on the same
    inputs, in fp64: causal, and under a DSA-like selection; the queries of every position (a prefill chunk) and of
    the last three only over the whole context (decodes); all at once and in slices of the queries."""
    from tandem.models.attention import PackedCausalAttention

    model = load_causal_lm(str(write_with_random_biases(shape, tmp_path / "m")), "cpu", "float32").double()
    attention, a, T = model.layers[1].self_attn, model.args, 20
    generator = torch.Generator().manual_seed(5)
    h = torch.randn(1, T, a.hidden_size, dtype=torch.float64, generator=generator)
    positions = torch.arange(T)[None]
    cos, sin = rope_cos_sin(positions, a.rotary_dim, a.rope_theta, torch.float64, a.rope_scaling)
    p = attention.project_latent(h, cos, sin)
    q, (k, v) = attention.queries(p.q_nope, p.q_rope), attention.keys_values(p.entries)  # what the model attends with
    causal = torch.ones(1, T, T, dtype=torch.bool).tril()
    chosen = causal & (torch.rand(1, T, T, generator=generator) < 0.5) | torch.eye(T, dtype=torch.bool)[None]
    dense = PackedCausalAttention(positions).attend(0, q, k, v)
    for visible in (causal, chosen):
        expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=visible[:, None]).transpose(1, 2)
        if visible is causal:
            torch.testing.assert_close(expected, dense, atol=1e-12, rtol=0)
        for form, max_pairs in itertools.product((attention.attend_expanded, attention.attend_absorbed), (None, 30, 100)):
            got = form(p.q_nope, p.q_rope, p.entries, visible, max_pairs)  # 30: one query a slice, 100: five
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
            last = form(p.q_nope[:, -3:], p.q_rope[:, -3:], p.entries, visible[:, -3:], max_pairs)
            torch.testing.assert_close(last, expected[:, -3:], atol=1e-12, rtol=0)
        order = (~visible).to(torch.uint8).argsort(dim=-1, stable=True)[..., :12]  # what each sees first, then others
        got = attention.attend_chosen(p.q_nope, p.q_rope, p.entries, order, visible.gather(-1, order))
        seen = visible.sum(-1) <= 12  # the queries whose every visible token is among their 12 positions
        torch.testing.assert_close(got[seen], expected[seen], atol=1e-12, rtol=0)
        assert not seen.all() and (got[~seen] - expected[~seen]).abs().max() > 1e-3
    assert (expected - dense).abs().max() > 1e-3  # the selection mattered


def test_a_rows_choice_scoring_each_slice_up_to_its_last_query_equals_the_choice_under_the_whole_mask():
    """`choose` over a packed row's `SparseContext` (a slice's keys only up to its last query, [T, T] never made)
    equals `choose` under the row's whole document-causal mask: in slices of one query, of several, all at once.
    Positive queries and keys: no two index scores tie at ReLU's zero."""
    from tandem.models.attention import document_causal_mask
    from tandem.models.dsa import choose, sparse_context

    generator = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in (5, 30, 12, 40)])[None]
    T, k = positions.shape[1], 10
    queries, keys = torch.rand(1, T, 3, 8, generator=generator), torch.rand(1, T, 8, generator=generator)
    weights = torch.randn(1, T, 3, generator=generator)
    context = sparse_context(positions, k)
    for max_pairs in (1, 7 * T, T * T):
        got = choose(queries, weights, keys, context.visible, k, max_pairs)
        expected = choose(queries, weights, keys, document_causal_mask(positions), k, max_pairs)
        assert got[0].shape == expected[0].shape == (1, T, k)
        assert torch.equal(got[1], expected[1]) and torch.equal(got[0][got[1]], expected[0][expected[1]])
        assert not got[1].all() and got[1].sum(-1).max() == k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_index_scores_of_bf16_on_cuda_are_the_fp32_scores_of_the_same_values():
    """bf16 queries and keys on CUDA (tensor-core products into fp32) against the fp32 path on the same values
    upcast: equal but for the order of fp32 sums, at GLM-5's indexer shape (32 heads of 128)."""
    from tandem.models.dsa import index_scores

    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(1, 300, 32, 128, generator=generator).bfloat16().cuda()
    keys = torch.randn(1, 700, 128, generator=generator).bfloat16().cuda()
    weights = torch.randn(1, 300, 32, generator=generator).cuda()
    got, expected = index_scores(queries, keys, weights), index_scores(queries.float(), keys.float(), weights)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_glm5_preset_is_the_released_shape():
    """Parameter count of the GLM-5 checkpoints' tensors (78 blocks and the multi-token prediction layer)."""
    model = build_native(preset_config("glm-5"), "meta")
    assert sum(p.numel() for p in model.parameters()) == 753_864_139_008
    assert model.layers[0].self_attn.indexer.wq_b.weight.shape == (32 * 128, 2048)
    assert model.layers[0].self_attn.kv_b_proj.weight.shape == (64 * (192 + 256), 512)


def test_multi_token_prediction_layer_is_kept_named_as_released_and_frozen(tmp_path):
    from safetensors import safe_open

    folder = init_model("tiny-glm5", tmp_path / "m")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
        eh_proj = f.get_tensor("model.layers.4.eh_proj.weight")
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.indexer.wq_b.weight",
            "model.layers.4.mlp.experts.7.up_proj.weight", "model.layers.4.mlp.gate.e_score_correction_bias"} <= on_disk
    assert not any("mtp" in name for name in on_disk)
    model = load_causal_lm(str(folder))
    mtp = model.model.mtp_layers[0]
    assert torch.equal(mtp.eh_proj.weight, eh_proj)
    assert not any(p.requires_grad for p in mtp.parameters())
    ids, positions = packed_row(model.args.vocab_size)
    with torch.no_grad():
        hidden = model(ids, positions)
        draft = model.predict_after_next(hidden, ids.roll(-1, 1), positions)
        other = model.predict_after_next(hidden, (ids + 1).roll(-1, 1), positions)
    assert draft.shape == hidden.shape and not torch.allclose(draft, other)


def test_the_mtp_layers_stored_copies_of_the_embedding_and_head_are_left_out(tmp_path):
    """DeepSeek-V3's checkpoints store in the MTP layer a copy of the model's embedding and LM head
    (`model.layers.61.embed_tokens.weight`, `model.layers.61.shared_head.head.weight`), which the layer shares: such a
    folder loads, with the weights of the same folder without the copies."""
    from safetensors.torch import load_file, save_file

    folder = init_model("tiny-deepseek-v3", tmp_path / "m")
    layer = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(folder / "model.safetensors"))
    copies = {f"model.layers.{layer}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
              f"model.layers.{layer}.shared_head.head.weight": tensors["lm_head.weight"].clone()}
    expected = load_causal_lm(str(folder)).state_dict()
    save_file(dict(tensors, **copies), str(folder / "model.safetensors"))
    got = load_causal_lm(str(folder)).state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_tensor_past_the_multi_token_prediction_layers_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = init_model("tiny-glm5", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(dict(tensors, **{"model.layers.5.eh_proj.weight": torch.zeros(2, 2)}), str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"unexpected \['model.mtp_layers.1.eh_proj.weight'\]"):
        load_causal_lm(str(folder))


@pytest.mark.parametrize("field, value", [
    ("indexer_types", ["full", "sparse", "full", "shared"]),
    ("indexer_types", ["shared", "full", "full", "full"]),
    ("indexer_rope_interleave", False),
    ("rope_interleave", False),
    ("num_key_value_heads", 2),
    ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]),
])
def test_unsupported_glm5_config_values_name_the_field_and_file(field, value, tmp_path):
    """Refused from the config alone: the folder holds no weights, so nothing was read."""
    folder = write_model(shape_config(TINY_GLM5), tmp_path / "m", weights=False)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: `{field}` = "):
        load_causal_lm(str(folder))


def test_both_names_transformers_gives_the_dsa_layer_read_as_one(tmp_path):
    """transformers 5.17's config names GLM-5's layers `deepseek_sparse_attention`, later versions
    `indexed_attention`: the same model either way; any other layer type is refused."""
    from tandem.models.glm_moe_dsa import GlmMoeDsaArgs
    from tandem.models.hf_config import UnsupportedConfig

    config = json.loads((write_model(shape_config(TINY_GLM5), tmp_path / "m", weights=False) / "config.json").read_text())
    args = [GlmMoeDsaArgs.from_hf(dict(config, layer_types=[kind] * config["num_hidden_layers"]))
            for kind in ("indexed_attention", "deepseek_sparse_attention")]
    assert args[0] == args[1]
    with pytest.raises(UnsupportedConfig, match="layer_types"):
        GlmMoeDsaArgs.from_hf(dict(config, layer_types=["sliding_attention"] * config["num_hidden_layers"]))


def test_only_a_shared_layer_is_handed_the_selection_before_it(tmp_path, monkeypatch):
    """tiny-glm5 (full, shared, full, shared) past top-k: each shared layer gets the choice of the full layer before
    it, a full layer none (it chooses its own; a choice handed to a checkpointed block would stay alive until its
    backward, one [T, index_topk] a layer in GLM-5, whose layers are all full)."""
    from tandem.models.glm_moe_dsa import LatentAttentionBlock

    model = load_causal_lm(str(write_model(shape_config(dict(TINY_GLM5, index_topk=4)), tmp_path / "m")))
    assert model.args.indexer_types == ["full", "shared", "full", "shared"]
    handed, made = [], []
    forward = LatentAttentionBlock.forward

    def recording(block, *args):
        handed.append(args[-1])
        out = forward(block, *args)
        made.append(out[1])
        return out

    monkeypatch.setattr(LatentAttentionBlock, "forward", recording)
    ids, positions = packed_row(model.args.vocab_size)
    with torch.no_grad():
        model(ids, positions)
    assert handed[0] is None and handed[2] is None
    assert handed[1] is made[0] and handed[3] is made[2] and made[0] is not None and made[2] is not made[0]


def test_the_indexer_passes_no_gradient(tmp_path):
    """Even with its weights made trainable, the selection is a choice without gradient."""
    model = load_causal_lm(str(write_model(shape_config(dict(TINY_GLM5, index_topk=4)), tmp_path / "m")))
    indexer = model.layers[0].self_attn.indexer
    indexer.requires_grad_(True)
    ids, positions = packed_row(model.args.vocab_size)
    model.lm_head(model(ids, positions)).logsumexp(-1).sum().backward()
    assert all(p.grad is None for p in indexer.parameters())
    assert model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum() > 0


def test_one_rl_step_trains_all_but_the_indexer_and_the_prediction_layer(tmp_path):
    """The real trainer on the CPU, documents past top-k: the step changes the attention and experts, the indexers,
    score biases and multi-token prediction layer stay as loaded."""
    from tandem.config.loader import parse_args
    from tandem.config.trainer import TrainerConfig
    from tandem.trainer.rl.train import main
    from tandem.transport.paths import weights_dir

    folder = write_model(shape_config(dict(TINY_GLM5, index_topk=8)), tmp_path / "m")
    args = ["--device", "cpu", "--model.name", str(folder), "--data.fake", "--data.fake-rows", "1",
            "--data.fake-samples-per-row", "2", "--max-steps", "1", "--seq-len", "40", "--output-dir", str(tmp_path / "run")]
    assert main(parse_args(TrainerConfig, args, environ={})) == 0
    before, after = load_state_dict(folder), load_state_dict(weights_dir(tmp_path / "run", 1))
    assert before.keys() == after.keys()
    unchanged = {name for name in before if torch.equal(before[name], after[name])}
    frozen = {name for name in before if ".indexer." in name or "mtp_layers" in name or "e_score_correction_bias" in name}
    assert unchanged == frozen
