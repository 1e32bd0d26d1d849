"""The offline wiki of `wiki_search`: fictional pages generated from templates, and BM25 search.

A corpus is a pure function of its seed (built once per process, in well under a second), so
every machine sees the same pages and no data file ships. `CORPUS_SEED` is the environment's
wiki; other seeds make other wikis of the same kinds of pages (the warm-up's drills). Its places, people and rivers are
invented, so a model cannot answer from memory: it has to search. Every page holds facts (a
year, a name, a number) in short sections, and each fact yields one question whose exact answer
is the fact's value, written in exactly one section.

Search is BM25 (`bm25s`, a maintained library on numpy) over each page's title and text.
"""

import random
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from tandem.envs.word_lists import load_word_list

CORPUS_SEED = 0
NUM_TOWNS = 120
NUM_PEOPLE = 100
NUM_RIVERS = 60
_TOKEN = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an and at by did does for from how in into is it its of on the to was what when where "
    "which who whom with".split()
)
_SYLLABLES = "bra cal dor el fen gar hal is kel lor mar nor or pel quin ros sel tor ul ven wyn zar".split()
_ENDINGS = "ia burg mora dale wick stead holm ford vik ton".split()
PROVINCES = ["Asterra", "Belmark", "Corvale", "Dunmere", "Eskeland", "Farrow", "Glenhaven"]
INDUSTRIES = ["fishing", "weaving", "glassmaking", "timber", "salt mining", "pottery", "cheesemaking", "shipbuilding"]
OCCUPATIONS = ["painter", "engineer", "botanist", "poet", "cartographer", "astronomer", "architect", "composer"]
AWARDS = ["Silver Quill", "Harbor Medal", "Lantern Prize", "Order of the Oak"]
SEAS = ["Amber Sea", "Northern Gulf", "Grey Bay", "Lake Sorrow"]
FISH = ["trout", "pike", "eels", "salmon", "perch"]


@dataclass(frozen=True)
class Section:
    id: str
    """`<page id>:<slug>`, unique in the corpus."""
    title: str
    text: str


@dataclass(frozen=True)
class Page:
    id: str
    title: str
    sections: tuple[Section, ...]


@dataclass(frozen=True)
class Fact:
    question: str
    answer: str
    page_id: str
    section_id: str


def slug(text: str) -> str:
    return "_".join(_TOKEN.findall(text.lower()))


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric words, stopwords dropped: what BM25 indexes and matches."""
    return [word for word in _TOKEN.findall(text.lower()) if word not in _STOPWORDS]


class _PageBuilder:
    """Collects one page's sections and the facts they state."""

    def __init__(self, title: str):
        self.title, self.id = title, slug(title)
        self.sections: list[Section] = []
        self.facts: list[Fact] = []

    def section(self, title: str, text: str, facts: dict[str, str]) -> None:
        """`facts` maps each question to its answer, which `text` must state."""
        section = Section(f"{self.id}:{slug(title)}", title, text)
        self.sections.append(section)
        for question, answer in facts.items():
            assert answer in text, (answer, text)
            self.facts.append(Fact(question, answer, self.id, section.id))

    def page(self) -> Page:
        return Page(self.id, self.title, tuple(self.sections))


def _unique_names(rng: random.Random, count: int, make: Any, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = make(rng)
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _place_name(rng: random.Random) -> str:
    return "".join(rng.sample(_SYLLABLES, rng.randint(1, 2))).capitalize() + rng.choice(_ENDINGS)


def _town(rng: random.Random, name: str, river: str, founder: str) -> _PageBuilder:
    page = _PageBuilder(name)
    province, year = rng.choice(PROVINCES), str(rng.randint(1100, 1899))
    page.section("Overview", f"{name} is a town in the province of {province}. It was founded in {year} by {founder}.",
                 {f"In which year was the town of {name} founded?": year,
                  f"Who founded the town of {name}?": founder,
                  f"In which province is the town of {name}?": province})
    elevation = str(rng.randint(2, 190) * 10)
    page.section("Geography", f"{name} lies on the {river} at an elevation of {elevation} metres.",
                 {f"On which river does the town of {name} lie?": river,
                  f"At what elevation, in metres, does the town of {name} lie?": elevation})
    industry, population = rng.choice(INDUSTRIES), str(rng.randint(12, 950) * 100)
    page.section("Economy", f"The main industry of {name} is {industry}. The town has {population} inhabitants.",
                 {f"What is the main industry of the town of {name}?": industry,
                  f"How many inhabitants does the town of {name} have?": population})
    return page


def _person(rng: random.Random, name: str, town: str) -> _PageBuilder:
    page = _PageBuilder(name)
    born, occupation = rng.randint(1700, 1960), rng.choice(OCCUPATIONS)
    page.section("Early life", f"{name} was born in {born} in the town of {town}.",
                 {f"In which year was {name} born?": str(born), f"In which town was {name} born?": town})
    award, year = rng.choice(AWARDS), str(born + rng.randint(25, 60))
    page.section("Career", f"{name} worked as a {occupation} and received the {award} in {year}.",
                 {f"What was the occupation of {name}?": occupation,
                  f"Which award did {name} receive?": award,
                  f"In which year did {name} receive the {award}?": year})
    return page


def _river(rng: random.Random, name: str) -> _PageBuilder:
    page = _PageBuilder(name)
    length, sea, mountains = str(rng.randint(12, 980)), rng.choice(SEAS), f"{_place_name(rng)} Mountains"
    page.section("Course", f"The {name} rises in the {mountains} and flows {length} kilometres into the {sea}.",
                 {f"How long, in kilometres, is the {name}?": length,
                  f"Into which body of water does the {name} flow?": sea,
                  f"Where does the {name} rise?": mountains})
    fish = rng.choice(FISH)
    page.section("Wildlife", f"The {name} is known for its {fish}.", {f"Which fish is the {name} known for?": fish})
    return page


@dataclass(frozen=True)
class Corpus:
    pages: dict[str, Page]
    sections: dict[str, Section]
    facts: tuple[Fact, ...]


@cache
def build_corpus(seed: int = CORPUS_SEED) -> Corpus:
    """Every page and fact of the wiki of `seed`; the same on every call and every machine."""
    rng = random.Random(seed)
    # Towns and rivers never share a name: "Lorvik" and "Lorvik River" would be one search.
    places = _unique_names(rng, NUM_RIVERS + NUM_TOWNS, _place_name, set())
    rivers = [f"{name} River" for name in places[:NUM_RIVERS]]
    towns = places[NUM_RIVERS:]
    people = rng.sample(load_word_list("names.txt"), NUM_PEOPLE)
    builders = [_river(rng, name) for name in rivers]
    builders += [_town(rng, name, rng.choice(rivers), rng.choice(people)) for name in towns]
    builders += [_person(rng, name, rng.choice(towns)) for name in people]
    pages = {b.id: b.page() for b in builders}
    assert len(pages) == len(builders), "page ids collide"
    sections = {s.id: s for page in pages.values() for s in page.sections}
    return Corpus(pages, sections, tuple(fact for b in builders for fact in b.facts))


class SearchIndex:
    """BM25 over pages (title and section text); `search` returns page ids, best first."""

    def __init__(self, corpus: Corpus):
        import bm25s

        self.page_ids = list(corpus.pages)
        documents = [
            tokenize(" ".join([page.title] + [f"{s.title} {s.text}" for s in page.sections]))
            for page in corpus.pages.values()
        ]
        self.retriever = bm25s.BM25()
        self.retriever.index(documents, show_progress=False)

    def search(self, query: str, k: int) -> list[str]:
        """Up to `k` page ids with a positive score (none when no query word is in the wiki)."""
        words = tokenize(query)
        if not words:
            return []
        found, scores = self.retriever.retrieve(
            [words], k=min(k, len(self.page_ids)), show_progress=False, n_threads=0  # 0: no thread pool (1 starts one for every query)
        )
        return [self.page_ids[i] for i, score in zip(found[0], scores[0]) if score > 0]


@cache
def search_index(seed: int = CORPUS_SEED) -> SearchIndex:
    return SearchIndex(build_corpus(seed))
