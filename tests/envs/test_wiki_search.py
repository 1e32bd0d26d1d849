import asyncio
import json

import pytest

from tandem.envs import load_environment, wiki_search
from tandem.envs.wiki_corpus import build_corpus, search_index, tokenize


def test_the_corpus_is_deterministic_and_every_fact_is_stated_once():
    corpus = build_corpus()
    assert len(corpus.pages) == 280 and len(corpus.facts) > 1000
    build_corpus.cache_clear()
    assert build_corpus() == corpus
    assert len({fact.question for fact in corpus.facts}) == len(corpus.facts)
    for fact in corpus.facts:
        assert fact.answer in corpus.sections[fact.section_id].text
        assert fact.section_id.startswith(f"{fact.page_id}:")


def test_search_finds_each_page_by_its_title_and_by_its_questions():
    corpus, index = build_corpus(), search_index()
    for page in corpus.pages.values():
        assert index.search(page.title, 3)[0] == page.id
    found = sum(index.search(fact.question, 3)[0] == fact.page_id for fact in corpus.facts)
    assert found / len(corpus.facts) > 0.95
    assert index.search("the of and", 3) == [] and index.search("qqqxqq", 3) == []
    assert tokenize("Who founded the town of Lorvik?") == ["founded", "town", "lorvik"]


def test_tools_read_the_wiki_and_reject_unknown_ids():
    fact = build_corpus().facts[0]
    hits = json.loads(wiki_search.search_pages(build_corpus().pages[fact.page_id].title))
    assert hits[0]["page_id"] == fact.page_id and len(hits) <= wiki_search.NUM_SEARCH_RESULTS
    sections = json.loads(wiki_search.view_sections(fact.page_id))
    assert fact.section_id in [s["section_id"] for s in sections]
    assert fact.answer in wiki_search.read_section(fact.section_id)
    assert wiki_search.search_pages("qqqxqq") == "No page matches."
    with pytest.raises(ValueError, match="no page_id 'nope'"):
        wiki_search.view_sections("nope")
    with pytest.raises(ValueError, match="no section_id"):
        wiki_search.read_section("nope:x")


def test_a_rollout_that_searches_and_answers_scores_one(scripted_client):
    env = load_environment("wiki-search", num_train_examples=10, num_eval_examples=5)
    example = env.get_eval_dataset(1)[0]
    page_id, section_id = example["info"]["page_id"], example["info"]["section_id"]

    def play(final: str):
        client = scripted_client([
            {"tool_calls": [("c1", "search_pages", {"query": example["prompt"][-1]["content"]})]},
            {"tool_calls": [("c2", "view_sections", {"page_id": page_id}), ("c3", "read_section", {"section_id": "x"})]},
            {"tool_calls": [("c4", "read_section", {"section_id": section_id})]},
            final,
        ])
        return asyncio.run(env.run_rollout(client, "m", example))

    right = play(f"<answer> {example['answer'].upper()}. </answer>")
    assert right.score.reward == 1.0
    tool_replies = [m["content"] for m in right.completion if m["role"] == "tool"]
    assert page_id in tool_replies[0] and section_id in tool_replies[1]
    assert tool_replies[2].startswith("Error: read_section raised ValueError")
    assert example["answer"] in tool_replies[3]
    assert right.score.metrics["num_tool_calls"] == 4 and right.score.metrics["num_tool_errors"] == 1
    assert play("<answer>wrong</answer>").score.reward == 0.0
    assert play(example["answer"]).score.reward == 0.0  # no <answer> tags


def test_splits_are_disjoint_seeded_and_bounded():
    env = wiki_search.load_environment(seed=1)
    train = {e["prompt"][-1]["content"] for e in env.get_dataset()}
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    assert len(evals) == 100 and len(train) == len(build_corpus().facts) - 100 and not train & evals
    assert wiki_search.load_environment(seed=1).get_eval_dataset() == env.get_eval_dataset()
    assert wiki_search.load_environment(seed=2).get_eval_dataset() != env.get_eval_dataset()
    with pytest.raises(ValueError, match="wiki_search has .* questions"):
        wiki_search.load_environment(num_train_examples=10_000)


def test_sft_examples_use_the_tools_on_training_questions_only(byte_tokenizer):
    from tandem.trainer.sft.data import tokenize_record

    env = wiki_search.load_environment(num_eval_examples=100, seed=4)
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    rows = wiki_search.sft_examples(20, seed=4, num_eval_examples=100)
    assert [r["messages"][1]["content"] for r in rows] == [e["prompt"][-1]["content"] for e in env.get_dataset(20)]
    assert not evals & {r["messages"][1]["content"] for r in rows}
    for row in rows:
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
        calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
        replies = [m["content"] for m in messages if m["role"] == "tool"]
        tools = {tool.__name__: tool for tool in wiki_search.TOOLS}
        assert replies == [tools[c["name"]](**json.loads(c["arguments"])) for c in calls]
        assert row["tools"] == env.oai_tools
        sample = tokenize_record(row, byte_tokenizer, ["assistant"], "row")
        assert sum(sample.loss_mask) > 0
    answers = [e["answer"] for e in env.get_dataset(20)]
    assert [wiki_search.exact_match_reward(r["messages"], a) for r, a in zip(rows, answers)] == [1.0] * 20


OTHER_WIKIS = dict(other_wikis=2, questions_per_other_wiki=6)


def test_the_default_warm_up_has_no_other_wikis_and_drills_come_before_the_demonstrations():
    rows = wiki_search.sft_examples(32, seed=4, **OTHER_WIKIS)
    assert wiki_search.sft_examples(20, seed=4) == wiki_search.sft_examples(20, seed=4, other_wikis=0) == rows[12:]
    assert all(row["messages"][0]["role"] == "user" and "tools" not in row for row in rows[:12])
    assert wiki_search.sft_examples(32, seed=4, **OTHER_WIKIS) == rows


def test_drills_are_whole_episodes_over_other_wikis_that_replay_with_their_tools(scripted_client):
    """Each drill is an episode of a wiki of another seed, about a page this wiki does not have, and an
    environment with that wiki's tools replays it: the same replies, reward 1."""
    from tandem.envs.rubric import Rubric
    from tandem.envs.tool_env import ToolEnv

    own = build_corpus()
    rubric = Rubric(funcs=[wiki_search.exact_match_reward], parser=wiki_search.PARSER)

    def replay(seed, fact, turns):
        env = ToolEnv(tools=wiki_search.wiki_tools(seed), max_turns=5, parser=wiki_search.PARSER, rubric=rubric,
                      dataset=[{"question": fact.question, "answer": fact.answer}])
        calls = [m["tool_calls"][0] for m in turns if m.get("tool_calls")]
        script = [{"tool_calls": [(c["id"], c["function"]["name"], c["function"]["arguments"])]} for c in calls]
        return asyncio.run(env.run_rollout(scripted_client(script + [turns[-1]["content"]]), "m", env.get_dataset()[0]))

    wikis_replayed = set()
    for row in wiki_search.sft_examples(12, seed=4, **OTHER_WIKIS):
        question, *turns = row["messages"]
        assert question["role"] == "user" and question["content"] not in {fact.question for fact in own.facts}
        asked = [(seed, fact) for seed in (1, 2) for fact in build_corpus(seed).facts if fact.question == question["content"]]
        assert asked and all(fact.page_id not in own.pages for _, fact in asked)
        rollouts = {seed: replay(seed, fact, turns) for seed, fact in asked}
        replayed = {seed for seed, r in rollouts.items() if r.completion == turns and r.score.reward == 1.0}
        assert replayed
        wikis_replayed |= replayed
    assert wikis_replayed == {1, 2}


@pytest.mark.parametrize("args, argument", [
    (dict(other_wikis=-1), "other_wikis"),
    (dict(other_wikis=1, questions_per_other_wiki=0), "questions_per_other_wiki"),
    (dict(other_wikis=1, questions_per_other_wiki=10_000), "questions_per_other_wiki"),
    (dict(other_wikis=3, questions_per_other_wiki=5), "other_wikis"),
])
def test_bad_other_wiki_arguments_are_named(args, argument):
    with pytest.raises(ValueError, match=argument):
        wiki_search.sft_examples(10, **args)
