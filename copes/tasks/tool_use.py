"""Synthetic tasks where tool calls pay, for the embedded tool-using model (copes/assets/tiny-agent).

- `tool-arithmetic`: "What is 4821*373-919?" Long products and chains are beyond a tiny model's head, but a
  one-line program for the Python tool (`print(4821*373-919)`) gets them right; a third of the questions are
  one-digit sums ("7+5"), cheaper answered directly, so the task mixes turns that need a tool with ones that do not.
- `tool-lookup`: questions about a seeded world of made-up people and towns ("In which country was Zorbin Quell
  born?"). No model can know the answers: they are in a small synthetic corpus that the search tool retrieves
  from (one hop: the person's passage; two hops: the person's, then their town's).

Both are chat tasks; the answer goes inside `<answer></answer>` and is scored by exact match (1.0 or 0.0). Every
split is a pure function of the seed: long arithmetic problems are assigned to splits by a hash of their text (the
100 one-digit sums, facts to know rather than problems to solve, are in every split), and lookup questions by a
hash of the person they ask about, so no held-out person ever appears in training data.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from copes.rewards import extract_answer
from copes.rewards.qa import normalize_official
from copes.tasks.base import Example, Score, TaskBase, check_split, register
from copes.tasks.synthetic import problem_split

SPLITS = ("train", "validation", "test")
ANSWER_INSTRUCTION = "Give the answer inside <answer></answer>."
_MAX_DRAWS_PER_QUESTION = 200


def _split_sizes(train_size: int | None, validation_size: int, test_size: int) -> dict[str, int | None]:
    """None: every question the split has (tool-lookup's train split, whose size depends on `hops`)."""
    sizes = {"train": train_size, "validation": validation_size, "test": test_size}
    for split, size in sizes.items():
        if size is not None and size < 0:
            raise ValueError(f"{split}_size must be >= 0, got {size}")
    return sizes


class _SeededSplits(TaskBase):
    """Splits generated on first use from `_generate(split, size)` and cached; exact-match scoring."""

    kind: str
    chat = True

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self._cache: dict[str, list[Example]] = {}

    def _generate(self, split: str, size: int) -> list[Example]:
        raise NotImplementedError

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        check_split(split, limit, SPLITS)
        if split not in self._cache:
            self._cache[split] = self._generate(split, self.sizes[split])
        return self._cache[split][:limit]

    def prompt(self, example: Example) -> str:
        return f"{example.question} {ANSWER_INSTRUCTION}"

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        answer = extract_answer(completion)
        correct = any(normalize_official(answer) == normalize_official(gold) for gold in example.golds)
        return Score(reward=float(correct), correct=correct, answer=answer)


# ---------------------------------------------------------------- arithmetic with the Python tool


def one_digit_sum(rng: random.Random) -> str:
    return f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"


def long_problem(rng: random.Random) -> str:
    """A product of 2-4 digit numbers, half the time followed by a third term."""
    left = rng.randint(10, 10 ** rng.randint(2, 4) - 1)
    right = rng.randint(10, 10 ** rng.randint(2, 3) - 1)
    expression = f"{left}*{right}"
    if rng.random() < 0.5:
        expression += f"{rng.choice('+-')}{rng.randint(1, 999)}"
    return expression


@register("tool-arithmetic")
class ToolArithmeticTask(_SeededSplits):
    """Options (all keyword): seed, split sizes."""

    name = "tool-arithmetic"
    kind = "math"

    def __init__(
        self, *, seed: int = 0, train_size: int = 30_000, validation_size: int = 500, test_size: int = 500
    ) -> None:
        super().__init__(_split_sizes(train_size, validation_size, test_size))
        self.seed = seed

    def _generate(self, split: str, size: int) -> list[Example]:
        """A third one-digit sums, facts a model is expected to know (like a times table: every split draws from
        all 100 of them, repeats included); the rest long problems, each unique and owned by one split."""
        rng = random.Random(f"tool-arithmetic/{self.seed}/{split}")
        seen: set[str] = set()
        examples: list[Example] = []
        for _ in range(size):
            needs_tool = rng.random() >= 1 / 3
            expression = one_digit_sum(rng)
            for _ in range(_MAX_DRAWS_PER_QUESTION if needs_tool else 0):
                expression = long_problem(rng)
                if expression not in seen and problem_split(expression) == split:
                    break
            else:
                if needs_tool:
                    raise ValueError(f"{split}_size={size} exceeds the {split} problems this generator reaches")
            seen.add(expression)
            # The expressions are only digits and + - *: eval is Python's own arithmetic on a literal we built.
            gold = str(eval(expression))  # noqa: S307
            examples.append(Example(id=f"{split}-{len(examples)}", question=f"What is {expression}?", golds=(gold,),
                                    meta={"expression": expression, "needs_tool": needs_tool}))
        return examples


# ---------------------------------------------------------------- lookup over a made-up world with search

_SYLLABLES = ("bar", "cor", "dun", "el", "fen", "gal", "hol", "ir", "jas", "kel", "lom", "mir", "nor", "os", "pel",
              "quin", "ras", "sel", "tor", "ul", "vas", "wen", "yor", "zan", "bri", "dra", "gli", "kro", "pra", "tre")
_COUNTRIES = 8
_TOWNS = 60
_PEOPLE = 6000


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


@dataclass(frozen=True)
class Town:
    name: str
    river: str
    country: str


@dataclass(frozen=True)
class Person:
    name: str
    town: Town
    job: str


_JOBS = ("baker", "potter", "weaver", "miller", "sailor", "mason", "scribe", "smith")


@dataclass(frozen=True)
class World:
    towns: tuple[Town, ...]
    people: tuple[Person, ...]

    def person(self, name: str) -> Person:
        return self._people_by_name[name]

    @functools.cached_property
    def _people_by_name(self) -> dict[str, Person]:
        return {person.name: person for person in self.people}

    def passages(self) -> list[tuple[str, str]]:
        """(title, text) of every corpus passage: one per town, one per person."""
        towns = [(t.name, f"{t.name} is a town on the river {t.river}, in {t.country}.") for t in self.towns]
        people = [(p.name, f"{p.name} is a {p.job}, born in {p.town.name}.") for p in self.people]
        return towns + people


@functools.lru_cache(maxsize=4)
def make_world(seed: int) -> World:
    """The made-up world of `seed`: distinct names throughout, every person born in one town."""
    rng = random.Random(f"tool-lookup/{seed}/world")
    used: set[str] = set()

    def fresh(syllables: int) -> str:
        while (name := _word(rng, syllables)) in used:
            pass
        used.add(name)
        return name

    countries = [fresh(3) for _ in range(_COUNTRIES)]
    rivers = [fresh(2) for _ in range(_TOWNS // 3)]
    towns = tuple(Town(fresh(3), rng.choice(rivers), rng.choice(countries)) for _ in range(_TOWNS))
    people = []
    places, name_pairs = set(used), set()
    while len(people) < _PEOPLE:
        first, last = _word(rng, 2), _word(rng, 2)
        name, pair = f"{first} {last}", frozenset((first, last))
        # A search for a person must find no town, and no "Last First" that BM25 (a bag of words) cannot tell apart.
        if first != last and pair not in name_pairs and first not in places and last not in places:
            name_pairs.add(pair)
            people.append(Person(name, rng.choice(towns), rng.choice(_JOBS)))
    return World(towns, tuple(people))


def person_split(name: str) -> str:
    """The split that owns every question about person `name` (validation and test 10% each)."""
    bucket = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % 10
    return {0: "validation", 1: "test"}.get(bucket, "train")


# (question template, the chain of facts that answers it): one hop reads the person's passage, two hops also the
# passage of the town found there.
LOOKUP_QUESTIONS = {
    "town": ("In which town was {name} born?", lambda person: person.town.name),
    "job": ("What is the job of {name}?", lambda person: person.job),
    "river": ("On which river is the town where {name} was born?", lambda person: person.town.river),
    "country": ("In which country was {name} born?", lambda person: person.town.country),
}
HOPS = {"town": 1, "job": 1, "river": 2, "country": 2}


@register("tool-lookup")
class ToolLookupTask(_SeededSplits):
    """Options (all keyword): seed, hops (which question kinds: 1, 2 or "1,2"), split sizes."""

    name = "tool-lookup"
    kind = "qa"

    def __init__(self, *, seed: int = 0, hops: str | int = "1,2", train_size: int | None = None,
                 validation_size: int = 500, test_size: int = 500) -> None:
        wanted = {int(hop) for hop in str(hops).split(",") if hop.strip()}
        if not wanted or not wanted <= {1, 2}:
            raise ValueError(f"hops must be 1, 2 or '1,2', got {hops!r}")
        super().__init__(_split_sizes(train_size, validation_size, test_size))
        self.seed = seed
        self.kinds = [kind for kind, hop in HOPS.items() if hop in wanted]
        self.world = make_world(seed)

    def _generate(self, split: str, size: int | None) -> list[Example]:
        rng = random.Random(f"tool-lookup/{self.seed}/{split}/{','.join(self.kinds)}")
        people = [person for person in self.world.people if person_split(person.name) == split]
        possible = len(people) * len(self.kinds)
        size = possible if size is None else size
        if size > possible:
            raise ValueError(f"{split}_size={size} exceeds the {possible} {split} questions of this world")
        pairs = [(person, kind) for person in people for kind in self.kinds]
        rng.shuffle(pairs)
        examples = []
        for person, kind in pairs[:size]:
            template, answer = LOOKUP_QUESTIONS[kind]
            examples.append(Example(id=f"{split}-{len(examples)}", question=template.format(name=person.name),
                                    golds=(answer(person),),
                                    meta={"person": person.name, "kind": kind, "hops": HOPS[kind]}))
        return examples

    def corpus_paragraphs(self, splits: Sequence[str] | None = None) -> list[tuple[str, str]]:
        """The whole world: the corpus is the same for every split (held-out people are searchable too)."""
        return self.world.passages()
