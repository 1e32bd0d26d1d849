"""pass@k, and `tandem eval` end to end against a fake server."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main as tandem_main
from tandem.monitor.metrics import read_metrics
from tandem.orchestrator.evaluation import k_values, pass_at_k


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="pass@5 needs at least 5 rollouts"):
        pass_at_k(4, 1, 5)


def test_k_values_are_powers_of_two_up_to_n():
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]


def test_tandem_eval_scores_a_builtin_environment(tmp_path, tiny_model, fake_servers, capsys):
    def reverse(prompt, rng):
        text = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        return f"<reversed_text>{text[::-1]}</reversed_text>"

    (backend, url), = fake_servers(respond=reverse)
    run_dir = tmp_path / "run"
    code = tandem_main(["eval", "--model.name", str(tiny_model), "--output_dir", str(run_dir),
                        "--client.base_urls", f'["{url}"]', "--eval.num_examples", "5",
                        "--eval.rollouts_per_example", "2", "--eval.temperature", "0", "--step", "7",
                        "--envs", '[{id = "reverse_text", args = {num_train_examples = 10, num_eval_examples = 5}}]'])
    assert code == 0
    (metrics,) = read_metrics(run_dir, "eval")
    assert metrics["step"] == 7 and metrics["eval/reward_mean"] == 1.0 and metrics["eval/pass@2"] == 1.0
    assert metrics["eval/reverse_text/num_rollouts"] == 10 and metrics["eval/num_failed"] == 0
    assert {r["temperature"] for r in backend.requests} == {0.0}
    assert sorted(r["seed"] for r in backend.requests) == list(range(10))  # run seed 0: one seed per rollout
    lines = (run_dir / "eval" / "step_7" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[0])["env"] == "reverse_text"
    printed = capsys.readouterr()
    assert "eval/pass@1" in printed.out
    assert "eval: rollout 10/10 (" in printed.err  # the progress line off a terminal, at the end


def test_tandem_eval_says_when_the_eval_split_is_smaller_than_asked(tmp_path, tiny_model, fake_servers, caplog):
    (_, url), = fake_servers(respond=lambda prompt, rng: "<reversed_text>x</reversed_text>")
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING", logger="tandem.orchestrator"):
        code = tandem_main(["eval", "--model.name", str(tiny_model), "--output_dir", str(run_dir),
                            "--client.base_urls", f'["{url}"]', "--eval.num_examples", "8", "--eval.rollouts_per_example", "1",
                            "--envs", '[{id = "reverse_text", args = {num_train_examples = 10, num_eval_examples = 3}}]'])
    assert code == 0
    (metrics,) = read_metrics(run_dir, "eval")
    assert metrics["eval/reverse_text/num_rollouts"] == 3
    assert "environment reverse_text has 3 eval examples, fewer than eval.num_examples = 8" in caplog.text


def test_tandem_eval_gives_pass_at_k_on_humaneval(tmp_path, tiny_model, fake_servers):
    """Each problem's first reply is its canonical solution, the second an empty body: every solution runs in
    the sandbox, so pass@1 = 0.5 and pass@2 = 1."""
    from tandem.envs.humaneval import load_problems

    problems = load_problems()
    num_replies: dict[str, int] = {}

    def solve_once(prompt, rng):
        problem = next(p for p in problems if p["prompt"].rstrip() in prompt)
        num_replies[problem["task_id"]] = num_replies.get(problem["task_id"], 0) + 1
        return problem["canonical_solution"] if num_replies[problem["task_id"]] == 1 else ""

    (_, url), = fake_servers(respond=solve_once)
    run_dir = tmp_path / "run"
    code = tandem_main(["eval", "--model.name", str(tiny_model), "--output_dir", str(run_dir), "--seq_len", "4096",
                        "--client.base_urls", url, "--sampling.max_tokens", "1024",
                        "--eval.num_examples", "4", "--eval.rollouts_per_example", "2", "--envs", '[{id = "humaneval"}]'])
    assert code == 0
    (metrics,) = read_metrics(run_dir, "eval")
    assert metrics["eval/humaneval/num_rollouts"] == 8 and metrics["eval/num_failed"] == 0
    assert metrics["eval/pass@1"] == 0.5 and metrics["eval/pass@2"] == 1.0
    assert sorted(num_replies.values()) == [2, 2, 2, 2]
