"""The orchestrator's tokenizer: a preset's folder loads it without torch, and it is the one AutoTokenizer gives."""

from __future__ import annotations

import subprocess
import sys

from tandem.config.base import ModelConfig
from tandem.orchestrator.tokenizer import has_generic_tokenizer, load_tokenizer


def test_a_preset_s_tokenizer_loads_without_torch_as_autotokenizer_loads_it(tiny_model, tokenizer):
    """The orchestrator never computes with torch, and importing it costs seconds of CPU at every start."""
    model = ModelConfig(name=str(tiny_model))
    assert has_generic_tokenizer(model) and not has_generic_tokenizer(model.model_copy(update={"trust_remote_code": True}))
    code = ("import sys; from tandem.config.base import ModelConfig; from tandem.orchestrator.tokenizer import "
            f"load_tokenizer; load_tokenizer(ModelConfig(name={str(tiny_model)!r})); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr[-2000:]
    loaded = load_tokenizer(model)
    messages = [{"role": "user", "content": "Reverse: héllo <|im_end|>"}, {"role": "assistant", "content": "olléh"}]
    assert type(loaded) is type(tokenizer) and loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
