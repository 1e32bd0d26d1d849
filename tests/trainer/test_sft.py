"""SFT: loss masks from chat templates, packing, step rows, and a tiny task whose loss goes down."""

from __future__ import annotations

import json
import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from tandem.config.loader import parse_args
from tandem.config.sft import SFTConfig
from tandem.models.chat import render_chat
from tandem.models.loading import load_causal_lm
from tandem.launch.warmup import write_sft_data
from tandem.trainer.sft.data import (SFTDataError, Sample, StepRows, encode_texts, load_samples, pack, read_records,
                                    tokenize_record)
from tandem.trainer.sft.train import main as sft_main
from tandem.transport.paths import STABLE, weights_dir

from trainer_helpers import losses, metrics

CHAT = {"messages": [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "abc"},
                     {"role": "assistant", "content": "cba"}, {"role": "user", "content": "xy"},
                     {"role": "assistant", "content": "yx"}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def loss_text(tokenizer, sample: Sample) -> list[str]:
    """The loss tokens decoded, one string per contiguous span."""
    spans, current = [], []
    for token, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans + ([tokenizer.decode(current)] if current else [])


def test_assistant_turns_are_the_loss_tokens_without_their_header(tokenizer):
    sample = tokenize_record(CHAT, tokenizer, ["assistant"], "row 1")
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert loss_text(tokenizer, sample) == ["cba<|im_end|>\n", "yx<|im_end|>\n"]


def test_a_rows_tools_are_rendered_as_rl_prompts_render_them(tokenizer):
    tool = {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {"type": "object"}}}
    sample = tokenize_record({**CHAT, "tools": [tool]}, tokenizer, ["assistant"], "row 1")
    prompt = render_chat(tokenizer, CHAT["messages"][:2], [tool], add_generation_prompt=True)
    assert sample.input_ids[:len(prompt)] == prompt
    assert '"name": "search"' in tokenizer.decode(sample.input_ids)
    assert loss_text(tokenizer, sample) == ["cba<|im_end|>\n", "yx<|im_end|>\n"]


def test_loss_roles_choose_the_roles(tokenizer):
    sample = tokenize_record(CHAT, tokenizer, ["user"], "row 1")
    assert loss_text(tokenizer, sample) == ["<|im_start|>user\nabc<|im_end|>\n", "<|im_start|>user\nxy<|im_end|>\n"]


def test_prompt_completion_rows_train_on_the_completion_and_eos(tokenizer):
    sample = tokenize_record({"prompt": "Reverse abc: ", "completion": "cba"}, tokenizer, ["assistant"], "row 1")
    assert loss_text(tokenizer, sample) == ["cba<|im_end|>"]


@pytest.mark.parametrize("record, message", [
    ({"text": "hi"}, "needs `messages`, or `prompt` and `completion`"),
    ({"messages": "hi"}, "non-empty list"),
    ({"prompt": 1, "completion": "x"}, "must be strings"),
])
def test_bad_rows_are_named(tokenizer, record, message):
    with pytest.raises(SFTDataError, match=f"row 7: .*{message}"):
        tokenize_record(record, tokenizer, ["assistant"], "data.jsonl: row 7")


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    rows = [CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.jsonl") == read_records(tmp_path / "d.parquet") == rows
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\nnot json\n')
    with pytest.raises(SFTDataError, match="bad.jsonl:2: invalid JSON"):
        read_records(tmp_path / "bad.jsonl")
    (tmp_path / "d.csv").write_text("messages\n")
    with pytest.raises(SFTDataError, match="unknown data format '.csv'"):
        read_records(tmp_path / "d.csv")


def test_long_samples_are_cut_and_samples_without_loss_tokens_dropped(tokenizer, tmp_path):
    rows = [{"prompt": "p", "completion": "c" * 50}, {"messages": [{"role": "user", "content": "only a question"}]},
            {"prompt": "q" * 60, "completion": "late"}, {"prompt": "ok ", "completion": "yes"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, counts = load_samples(tmp_path / "d.jsonl", tokenizer, ["assistant"], seq_len=32)
    assert counts == {"rows": 4, "truncated": 2, "dropped_no_loss_tokens": 2}
    assert [len(s.input_ids) for s in samples] == [32, 3 + 3 + 1]
    assert all(s.loss_mask[0] == 0 for s in samples)


def test_rows_tokenized_in_chunks_report_progress_and_give_each_rows_own_sample(tokenizer, tmp_path, monkeypatch):
    rows = [CHAT, {"prompt": "Reverse abc: ", "completion": "cba"}] * 5
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr("tandem.trainer.sft.data.ENCODE_CHUNK", 4)
    calls = []
    samples, _ = load_samples(tmp_path / "d.jsonl", tokenizer, ["assistant"], seq_len=256, progress=lambda *a: calls.append(a))
    assert calls == [(0, 10), (4, 10), (8, 10), (10, 10)]
    alone = [tokenize_record(r, tokenizer, ["assistant"], "row") for r in rows]
    for sample in alone:
        sample.loss_mask[0] = 0
    assert samples == alone


def test_a_warm_up_files_first_steps_hold_the_rows_of_each_text_tokenized_alone(tokenizer, tmp_path, monkeypatch):
    """The reverse-text warm-up's own rows, tokenized in one batch by the tokenizer's backend, make the same rows of
    the same steps as texts given to `tokenizer.encode` one at a time."""
    write_sft_data("reverse_text", tmp_path / "train.jsonl", 300, 1, {"misclosed_fraction": 0.3})
    batched, _ = load_samples(tmp_path / "train.jsonl", tokenizer, ["assistant"], seq_len=1024)
    monkeypatch.setattr("tandem.trainer.sft.data.encode_texts",
                        lambda tok, texts: [tok.encode(text, add_special_tokens=False) for text in texts])
    alone, _ = load_samples(tmp_path / "train.jsonl", tokenizer, ["assistant"], seq_len=1024)
    assert batched == alone
    steps = [StepRows(samples, 1024, 4, shuffle=True, seed=0) for samples in (batched, alone)]
    assert steps[0].rows_per_epoch > 3 * 4
    for step in (1, 2, 3):
        assert steps[0].rows_for(step, 0, 1) == steps[1].rows_for(step, 0, 1)


def test_a_tokenizer_that_truncates_by_its_own_config_still_encodes_whole_texts(tiny_model, tmp_path):
    """A `tokenizer.json` may set truncation, which transformers' calls turn off and its backend alone would apply."""
    shutil.copytree(tiny_model, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    config["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "model" / "tokenizer.json").write_text(json.dumps(config))
    truncating = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    assert truncating.backend_tokenizer.truncation is not None
    texts = ["the whole of a longer text", "another one"]
    ids = encode_texts(truncating, texts)  # first: `encode` below turns the backend's truncation off
    assert ids == [truncating.encode(text, add_special_tokens=False) for text in texts]
    assert len(ids[0]) > 4


def test_packing_keeps_every_sample_once_within_seq_len():
    rng = random.Random(0)
    samples = [Sample(list(range(n)), [0] + [1] * (n - 1)) for n in (rng.randint(2, 30) for _ in range(50))]
    rows = pack(samples, seq_len=40)
    assert all(len(r.input_ids) <= 40 for r in rows)
    lengths = sorted(b - a for r in rows for a, b in zip(*_bounds(r.position_ids)))
    assert lengths == sorted(len(s.input_ids) for s in samples)
    assert len(rows) < len(samples)  # it packs


def _bounds(positions):
    starts = [i for i, p in enumerate(positions) if p == 0]
    return starts, starts[1:] + [len(positions)]


def test_step_rows_are_a_function_of_the_step_and_split_across_ranks():
    samples = [Sample(list(range(n)), [0] + [1] * (n - 1)) for n in range(2, 40)]
    rows = StepRows(samples, seq_len=48, rows_per_step=4, shuffle=True, seed=3)
    again = StepRows(samples, seq_len=48, rows_per_step=4, shuffle=True, seed=3)
    for step in range(1, 3 * rows.rows_per_epoch):  # crosses epochs
        whole, _ = rows.rows_for(step, 0, 1)
        halves = again.rows_for(step, 0, 2)[0] + again.rows_for(step, 1, 2)[0]
        assert whole == halves and len(whole) == 4
    epoch0 = [r.input_ids for r in rows.epoch_rows(0)]
    assert epoch0 != [r.input_ids for r in rows.epoch_rows(1)]  # reshuffled each epoch
    with pytest.raises(SFTDataError, match="multiple of the world size"):
        rows.rows_for(1, 0, 3)


def reverse_text_data(path, n, seed):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 7)))
            f.write(json.dumps({"messages": [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]}) + "\n")
    return path


def sft(*args: str) -> int:
    return sft_main(parse_args(SFTConfig, ["--device", "cpu", *args], environ={}))


def test_sft_on_a_tiny_task_lowers_the_loss(tiny_model, tmp_path):
    train = reverse_text_data(tmp_path / "train.jsonl", 200, seed=0)
    held_out = reverse_text_data(tmp_path / "eval.jsonl", 20, seed=1)
    out = tmp_path / "run"
    assert sft("--model.name", str(tiny_model), "--data.path", str(train), "--data.eval-path", str(held_out),
               "--eval.interval", "10", "--max-steps", "30", "--seq-len", "256", "--data.rows-per-step", "2",
               "--optim.lr", "3e-3", "--output-dir", str(out)) == 0
    records = metrics(out, "sft")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < 0.6 * records[0]["loss"] and evals == sorted(evals, reverse=True)
    assert records[0]["loss"] == pytest.approx(5.56, abs=0.3)  # ln(260): uniform at init
    final = out / "weights" / "final"
    assert final.resolve() == weights_dir(out, 30).resolve() and (final / STABLE).is_file()
    load_causal_lm(str(final))  # RL can start from it


def test_sft_resume_sees_the_same_rows(tiny_model, tmp_path):
    train = reverse_text_data(tmp_path / "train.jsonl", 40, seed=0)
    common = ["--model.name", str(tiny_model), "--data.path", str(train), "--seq-len", "64", "--data.rows-per-step", "2",
              "--optim.lr", "3e-3", "--ckpt.enabled", "--ckpt.interval", "2", "--data.eval-fraction", "0.1"]
    assert sft(*common, "--max-steps", "4", "--output-dir", str(tmp_path / "a")) == 0
    assert sft(*common, "--max-steps", "2", "--output-dir", str(tmp_path / "b")) == 0
    # The schedule is constant, so a longer max_steps changes nothing but the length of the run.
    assert sft(*common, "--max-steps", "4", "--output-dir", str(tmp_path / "b"), "--ckpt.resume") == 0
    assert losses(tmp_path / "a", "sft") == losses(tmp_path / "b", "sft")


def test_sft_bad_data_is_a_clear_error(tiny_model, tmp_path, caplog):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "no format"}) + "\n")
    assert sft("--model.name", str(tiny_model), "--data.path", str(tmp_path / "d.jsonl"), "--max-steps", "1",
               "--output-dir", str(tmp_path)) == 1
    assert "d.jsonl: row 1: a row needs `messages`" in caplog.text


def test_sft_config_requires_eval_data_for_eval():
    from tandem.config.loader import ConfigError

    with pytest.raises(ConfigError, match="no eval data"):
        parse_args(SFTConfig, ["--data.path", "x.jsonl", "--eval.interval", "5"], environ={})
    with pytest.raises(ConfigError, match="missing required key `data`"):
        parse_args(SFTConfig, [], environ={})


def test_sft_refuses_to_share_a_base_with_servers_it_has_not():
    from tandem.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"`lora.share_base` shares the base with an RL run's inference servers"):
        parse_args(SFTConfig, ["--data.path", "x.jsonl", "--lora.enabled", "true", "--lora.share_base", "true"], environ={})
