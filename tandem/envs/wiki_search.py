"""wiki_search: answer questions about an offline wiki with search tools.

The wiki (`wiki_corpus`) is invented, so the answers are in it and nowhere else. Tools:
`search_pages(query)` lists the best BM25 matches, `view_sections(page_id)` a page's sections,
`read_section(section_id)` one section's text. The model answers without a tool call, inside
`<answer>` tags. Reward = 1 when the answer equals the fact exactly, ignoring case, surrounding
spaces and a final period; else 0. Tool counts and the format score are metrics only.

Train and eval questions are disjoint (eval drawn first, as in the other built-ins); they may ask
about different facts of the same page.
"""

import json
import random
from collections.abc import Callable
from typing import Any

from tandem.envs.parsers import XMLParser
from tandem.envs.rubric import Rubric
from tandem.envs.splits import split_items
from tandem.envs.tool_env import ToolEnv, demo_tool_turn
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import Messages
from tandem.envs.wiki_corpus import CORPUS_SEED, Fact, build_corpus, search_index

SYSTEM_PROMPT = (
    "Answer the question with the wiki tools: search_pages finds pages, view_sections lists a "
    "page's sections, read_section reads one. Give the final answer inside <answer> tags."
)
PARSER = XMLParser(["answer"])
NUM_SEARCH_RESULTS = 3


def wiki_tools(corpus_seed: int) -> list[Callable[..., str]]:
    """The three tools over the wiki of `corpus_seed`: the environment's (`TOOLS`) for
    `CORPUS_SEED`, the same tools over another wiki for the warm-up's drills."""

    def search_pages(query: str) -> str:
        """Search the wiki for pages matching a query.

        Args:
            query: Words to look for, e.g. a name or a place.
        """
        pages = build_corpus(corpus_seed).pages
        found = search_index(corpus_seed).search(query, NUM_SEARCH_RESULTS)
        hits = [{"page_id": i, "title": pages[i].title} for i in found]
        return json.dumps(hits) if hits else "No page matches."

    def view_sections(page_id: str) -> str:
        """List the sections of a wiki page.

        Args:
            page_id: A page id from search_pages.
        """
        page = _lookup(build_corpus(corpus_seed).pages, page_id, "page_id", "search_pages")
        return json.dumps([{"section_id": s.id, "title": s.title} for s in page.sections])

    def read_section(section_id: str) -> str:
        """Read one section of a wiki page.

        Args:
            section_id: A section id from view_sections.
        """
        return _lookup(build_corpus(corpus_seed).sections, section_id, "section_id", "view_sections").text

    return [search_pages, view_sections, read_section]


def _lookup(table: dict[str, Any], key: str, name: str, source: str) -> Any:
    if key not in table:
        raise ValueError(f"no {name} {key!r}; use one that {source} returned")
    return table[key]


TOOLS = wiki_tools(CORPUS_SEED)
search_pages, view_sections, read_section = TOOLS


def normalize(text: str) -> str:
    return " ".join(text.split()).lower().removesuffix(".")


def exact_match_reward(completion: Messages, answer: str) -> float:
    parsed = PARSER.parse_answer(completion)
    return float(parsed is not None and normalize(parsed) == normalize(answer))


def _split_facts(num_train_examples: int, num_eval_examples: int, seed: int) -> tuple[list[Fact], list[Fact]]:
    return split_items(build_corpus().facts, num_train_examples, num_eval_examples, seed, "wiki_search has {} questions")


def _row(fact: Fact) -> dict[str, Any]:
    return {"question": fact.question, "answer": fact.answer, "task": "wiki_search",
            "info": {"page_id": fact.page_id, "section_id": fact.section_id}}


def load_environment(
    num_train_examples: int = -1, num_eval_examples: int = 100, seed: int = 0, max_turns: int = 6, **kwargs: Any
) -> ToolEnv:
    """`num_train_examples` -1 takes every question not in the eval set."""
    train, eval_facts = _split_facts(num_train_examples, num_eval_examples, seed)
    rubric = Rubric(funcs=[exact_match_reward, PARSER.get_format_reward_func()], weights=[1.0, 0.0], parser=PARSER)
    return ToolEnv(
        tools=TOOLS,
        max_turns=max_turns,
        dataset=[_row(fact) for fact in train],
        eval_dataset=[_row(fact) for fact in eval_facts],
        system_prompt=SYSTEM_PROMPT,
        parser=PARSER,
        rubric=rubric,
        **kwargs,
    )


def _demonstration(fact: Fact, corpus_seed: int, system_prompt: bool, searched: dict[tuple[int, str], str]) -> Messages:
    """Search for the fact's page by its title, list its sections, read the one holding the
    fact, answer: each call made with the tools of the fact's wiki, each reply theirs.
    `searched` keeps the search's reply for each (wiki, title): a page's facts all make the same search,
    the dearest step of writing a large warm-up (`benchmarks/RESULTS.md`)."""
    search, view, read = wiki_tools(corpus_seed)
    title = build_corpus(corpus_seed).pages[fact.page_id].title
    if (corpus_seed, title) not in searched:
        searched[corpus_seed, title] = search(title)
    messages: Messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system_prompt else []
    messages.append({"role": "user", "content": fact.question})
    messages += demo_tool_turn("call_1", "search_pages", {"query": title}, searched[corpus_seed, title])
    messages += demo_tool_turn("call_2", "view_sections", {"page_id": fact.page_id}, view(fact.page_id))
    messages += demo_tool_turn("call_3", "read_section", {"section_id": fact.section_id}, read(fact.section_id))
    messages.append({"role": "assistant", "content": PARSER.format(answer=fact.answer)})
    return messages


def _other_wiki_facts(num_wikis: int, questions_per_wiki: int, seed: int) -> list[tuple[Fact, int]]:
    """(fact, corpus seed) for `questions_per_wiki` questions drawn from each of the wikis of seeds
    `CORPUS_SEED + 1` on, about pages whose id the environment's wiki does not have (a name both
    wikis drew, e.g. a person's, would be a page of this wiki with other facts)."""
    own_pages, rng = build_corpus().pages, random.Random(seed)
    drawn = []
    for corpus_seed in range(CORPUS_SEED + 1, CORPUS_SEED + 1 + num_wikis):
        facts = [fact for fact in build_corpus(corpus_seed).facts if fact.page_id not in own_pages]
        if questions_per_wiki > len(facts):
            raise ValueError(f"questions_per_other_wiki={questions_per_wiki}: wiki {corpus_seed} has {len(facts)} "
                             "questions about pages this wiki does not have")
        drawn += [(fact, corpus_seed) for fact in rng.sample(facts, questions_per_wiki)]
    return drawn


def sft_examples(
    n: int, seed: int = 0, num_eval_examples: int = 100, other_wikis: int = 0, questions_per_other_wiki: int = 600
) -> list[dict[str, Any]]:
    """`n` chats `{"messages": [...], "tools": [...]}` that search for the question's page by its
    title, list its sections, read the one holding the fact and answer: the tool-use format, with
    the tools' real replies. They are the first training questions of `load_environment` with
    the same seed and `num_eval_examples`, so they never contain its eval questions. `tools` holds
    the schemas the chat template must render, as in RL.

    `other_wikis`: the first `other_wikis * questions_per_other_wiki` of the `n` chats are instead
    whole episodes over that many other generated wikis (their own tools' replies), without the
    system prompt and the tool schemas: short rows whose loss falls densely on copies (the name
    into the search, the page and section ids, the answer), which the tiny model did not learn
    from this wiki's demonstrations alone (examples/wiki_search/README.md). The rest, the last
    rows, are this wiki's demonstrations, so the tail a warm-up holds out for eval loss is too."""
    if other_wikis < 0:
        raise ValueError(f"other_wikis must be >= 0, got {other_wikis}")
    if questions_per_other_wiki < 1:
        raise ValueError(f"questions_per_other_wiki must be >= 1, got {questions_per_other_wiki}")
    drills = _other_wiki_facts(other_wikis, questions_per_other_wiki, seed)
    if len(drills) > n:
        raise ValueError(f"other_wikis={other_wikis} x questions_per_other_wiki={questions_per_other_wiki} "
                         f"episodes do not fit in the {n} examples asked")
    train, _ = _split_facts(n - len(drills), num_eval_examples, seed)
    tools = [tool_schema(tool) for tool in TOOLS]
    searched: dict[tuple[int, str], str] = {}
    return [{"messages": _demonstration(fact, corpus_seed, False, searched)} for fact, corpus_seed in drills] + [
        {"messages": _demonstration(fact, CORPUS_SEED, True, searched), "tools": tools} for fact in train
    ]
