"""vLLM on the workloads of `benchmarks/inference.py`: the side-by-side anchor of tandem's engine.

`benchmarks/inference.py --parts ...,vllm` runs this file in a child process (vLLM starts its own
engine process and takes a fixed share of GPU memory, so it must not share a process with
tandem's engine), on the same model folder, prompts and machine, and merges what it prints.
Alone:

    python benchmarks/vllm_workloads.py --model DIR --spec spec.json --out vllm.json

`spec.json` holds `workloads` ({"A": {...}, "B": {...}, ...} as in inference.py, any of them) and
`prompts` ({"A": [[ids...]], "B": [...], ...}); each runs with the sampled token's logprob, A also
without. Weights are vLLM's dummy (random) ones: the figures are about speed, and the model folder
needs only its config.json. Every run samples at temperature 1 with
EOS ignored; `logprobs=0` asks for the sampled token's logprob only, what RL needs, and is the
setting comparable to tandem's engine, which always returns it. Imports nothing from tandem.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run(llm, prompts: list[list[int]], w: dict, logprobs: int | None) -> dict:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=w["n"], temperature=1.0, top_p=1.0, top_k=0, max_tokens=w["output_len"], ignore_eos=True,
                            logprobs=logprobs, detokenize=False, seed=None)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed, "logprobs": logprobs}
    if logprobs is not None:
        result["logprobs_returned"] = all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
                                          for o in outputs for c in o.outputs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (config.json)")
    parser.add_argument("--spec", required=True, help="JSON file with workloads and prompts")
    parser.add_argument("--out", required=True, help="write the figures here")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's `kv_cache_dtype`: auto (the model's dtype) or fp8 (e4m3, per-tensor scales)")
    args = parser.parse_args()
    import vllm
    from vllm import LLM

    spec = json.loads(Path(args.spec).read_text())
    workloads, prompts = spec["workloads"], spec["prompts"]
    max_len = max(w["prompt_len"] + w["output_len"] for w in workloads.values())
    max_seqs = max(w["num_prompts"] * w["n"] for w in workloads.values())
    start = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=max_len, max_num_seqs=max_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_dtype=args.kv_cache_dtype)
    results: dict = {"vllm": vllm.__version__, "build_s": time.perf_counter() - start, "kv_cache_dtype": args.kv_cache_dtype}
    first = next(iter(workloads))
    run(llm, [[(t + 7) % 256 for t in p] for p in prompts[first][:4]], {**workloads[first], "n": 1, "output_len": 8}, 0)  # warmup
    for key, w in workloads.items():
        report(results, f"vllm_{key}_logprobs", run(llm, prompts[key], w, 0))
        if key == "A":  # fresh prompts (shifted ids), so the prefix cache of one run does not serve the next
            report(results, "vllm_A_no_logprobs", run(llm, [[(t + 1) % 256 for t in p] for p in prompts["A"]], w, None))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def report(results: dict, key: str, result: dict) -> None:
    """Keep a workload's figures and print them at once, so a run stopped later (a time limit) still shows them."""
    results[key] = result
    print(f"--- {key}\n{json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
