"""The token texts and bytes that logprobs report: filled ahead of time or cached per id, always what one id decodes to."""

from __future__ import annotations

from transformers import AutoTokenizer

from tandem.inference.openai_api import chat_logprobs, legacy_logprobs
from tandem.inference.serving import Served


def served_for(folder) -> Served:
    return Served(None, AutoTokenizer.from_pretrained(str(folder)), "m", 64)


def test_the_filled_table_is_each_ids_own_decode(tiny_dir):
    filled, fresh = served_for(tiny_dir), served_for(tiny_dir)
    vocab = len(filled.tokenizer) + 40  # a model's vocabulary may be larger than its tokenizer's
    filled.fill_token_texts(vocab, chunk=7)
    assert len(filled._token_text) == vocab
    assert [filled.token_text(i) for i in range(vocab)] == [fresh.tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab)]


def test_logprob_entries_name_each_token_by_its_text_and_bytes(tiny_dir):
    served = served_for(tiny_dir)
    ids, logprobs = [104, 105, 0xC3, 0xA9, 104], [-0.5, -1.0, -1.5, -2.0, -2.5]
    top = [((105, -0.7),), (), (), ((104, -3.0), (0xC3, -4.0)), ()]
    content = chat_logprobs(served, ids, logprobs, top)["content"]
    assert [e["token"] for e in content] == [served.token_text(t) for t in ids]
    assert [e["bytes"] for e in content] == [list(served.token_bytes(t)) for t in ids] == [[104], [105], [0xC3], [0xA9], [104]]
    assert [e["logprob"] for e in content] == logprobs
    assert content[3]["top_logprobs"] == [{"token": served.token_text(a), "logprob": lp, "bytes": list(served.token_bytes(a))}
                                          for a, lp in top[3]]
    assert content[1]["top_logprobs"] == []
    legacy = legacy_logprobs(served, ids, logprobs, top, with_top=True)
    texts = [served.token_text(t) for t in ids]
    assert legacy["tokens"] == texts and legacy["token_logprobs"] == logprobs
    assert legacy["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(ids))]
    assert legacy["top_logprobs"][3] == {served.token_text(104): -3.0, served.token_text(0xC3): -4.0}
    assert legacy_logprobs(served, [], [], [], with_top=False) == {"tokens": [], "token_logprobs": [], "top_logprobs": None,
                                                                  "text_offset": []}
