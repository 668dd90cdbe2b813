"""The chat base's synthetic pretraining data: tool use with made-up tools, and the built-in tasks.

Everything is drawn from a ``random.Random`` the caller seeds, so a seed gives the same data
on every machine. An example is a chat (``messages`` and ``tools`` as
``apply_chat_template`` takes them) plus what the evaluation needs to judge it.

**Made-up tools.** A tool is built around a *keyword* (what it returns: a made-up word such
as ``vorbel``, a made-up compound, or a real noun such as ``altitude``) and an *entity* (what
its one required argument names: a city, a user id, a product code, a made-up thing). Its
name is derived from the keyword in most tools (``get_vorbel``, ``vorbel_lookup``) and is a
random word in the rest; its description says what it returns for which entity; its schema
is the one ``marlaas.tools`` writes for a Python function (``properties`` with a
``description`` and a ``type``, ``required``, ``additionalProperties: false``), sometimes
with an extra optional parameter. A question asks for the keyword of a value; the episode is
the call (the right tool among 1-3 shown, the value copied into the argument), the tool's
response (a made-up result) and the answer (the result, bare or in a sentence). To do well
on a tool it has never seen the model has to match the question's words to a description
and copy a name and a value: no memorised tool helps.

**Held out.** Every made-up word and real noun belongs to one of two disjoint splits by a
hash of its spelling (``split_of``): training tools, arguments and results use the
``train`` split only; the evaluation's tools (:func:`heldout_tools`) use ``heldout`` words
only, so their names, keywords and values appear nowhere in the training data. Question,
description and answer *templates* are shared (they are the language, not the tools).

**Built-in tasks in chat form.** ``addition``, ``reverse``, ``repeat`` as a user turn (the
task's own prompt) and the answer; ``multiply`` with the ``calculator`` tool's schema (as
the env service announces it) and a call, the product as response, the product as answer.
"""

from __future__ import annotations

import json
import random
import string
import zlib
from dataclasses import dataclass, field

from marlaas.tasks.agentic import Multiply
from marlaas.tasks.toy import Addition, Repeat, Reverse

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "kr",
          "pl", "qu", "sk", "st", "th", "tr", "vr", "zh", "ch", "sh")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "y")
CODAS = ("", "", "", "", "n", "r", "l", "s", "x", "m", "k")

REAL_NOUNS = (
    "altitude", "population", "capital", "currency", "language", "temperature", "rainfall", "humidity",
    "price", "rating", "owner", "address", "birthday", "salary", "manager", "status", "balance", "score",
    "color", "weight", "height", "length", "speed", "distance", "volume", "density", "voltage", "capacity",
    "mayor", "founder", "motto", "anthem", "flag", "timezone", "area", "elevation", "depth", "age",
    "author", "publisher", "genre", "director", "budget", "revenue", "profit", "inventory", "supplier",
    "warranty", "color code", "zip code", "phone number", "email", "nickname", "species", "habitat",
    "diet", "lifespan", "orbit", "mass", "radius", "gravity", "moon count", "ticket price", "gate",
    "platform", "departure time", "arrival time", "delay", "seat count", "fuel level", "mileage",
    "engine type", "top speed", "battery level", "firmware version", "ip address", "uptime", "latency",
    "error rate", "disk usage", "memory usage", "queue length", "exchange rate", "interest rate",
    "tax rate", "shipping cost", "delivery date", "stock level", "shelf", "aisle", "recipe", "calories",
    "spice level", "cooking time", "opening hours", "closing time", "head chef", "coach", "captain",
    "team size", "league", "ranking", "record", "champion", "stadium", "mascot", "sponsor", "dialect",
    "alphabet", "word count", "rhyme", "synonym", "antonym", "translation", "plural", "origin",
)

# (parameter name, entity phrase, kind of value)
ENTITIES = (
    ("city", "city", "place"), ("country", "country", "place"), ("town", "town", "place"),
    ("planet", "planet", "place"), ("name", "person", "person"), ("person", "person", "person"),
    ("user_id", "user", "number"), ("account_id", "account", "number"), ("order_id", "order", "number"),
    ("code", "product code", "code"), ("sku", "product", "code"), ("flight", "flight", "code"),
    ("symbol", "stock symbol", "symbol"), ("ticker", "company", "symbol"), ("word", "word", "word"),
    ("term", "term", "word"), ("date", "date", "date"), ("day", "day", "date"), ("host", "server", "word"),
    ("team", "team", "place"), ("book", "book", "title"), ("title", "film", "title"),
)
NAME_FORMS = ("get_{k}", "get_{k}", "lookup_{k}", "{k}_lookup", "find_{k}", "fetch_{k}", "{k}", "{e}_{k}",
              "query_{k}", "{k}_of_{e}")
DESCRIPTIONS = (
    "Look up the {k} of a {e}.", "Returns the {k} for the given {e}.", "Get the current {k} of a {e}.",
    "Find the {k} of a {e}.", "Fetch {k} data for one {e}.", "Tells you the {k} of any {e}.",
    "Return the {k} of the {e} you name.", "Gives the {k} of a {e}, as text.",
)
PARAM_DESCRIPTIONS = ("The {e}.", "The {e} to look up.", "Which {e}.", "Name of the {e}.", "The {e} to query.")
QUESTIONS = (
    "What is the {k} of {v}?", "Find the {k} for {v}.", "I need the {k} of {v}.", "{v}: what is its {k}?",
    "Tell me the {k} of {v}, please.", "What's the {k} of {v}?", "Look up the {k} of {v}.",
    "Can you get the {k} for {v}?", "what is the {k} of {v}", "Please find {v}'s {k}.",
)
ANSWERS = ("{r}", "{r}", "The {k} of {v} is {r}.", "It is {r}.", "{r}.")
OPTIONAL_PARAMS = (("units", "string", "Units of the result."), ("verbose", "boolean", "More detail."),
                   ("limit", "integer", "At most this many."), ("lang", "string", "Language of the answer."))
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "Use the tools when they help.",
           "You are an assistant with tools.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly (integers stay exact).",
    "parameters": {"type": "object", "properties": {"expression": {
        "description": 'numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10".', "type": "string"}},
        "required": ["expression"], "additionalProperties": False},
}}


def split_of(word: str) -> str:
    """The split a word belongs to: a fifth of all spellings are held out, by a stable hash."""
    return "heldout" if zlib.crc32(word.lower().encode()) % 5 == 0 else "train"


@dataclass(frozen=True)
class MadeUpTool:
    """One made-up tool and what answering through it needs."""

    name: str
    keyword: str
    entity: str
    param: str
    kind: str
    schema: dict = field(hash=False, compare=False)


@dataclass
class Episode:
    """A chat to train on or to evaluate: ``messages`` up to the final answer, and the facts to judge it."""

    task: str
    messages: list[dict]
    tools: list[dict] | None = None
    tool: str | None = None  # the tool the model should call, when it should call one
    arguments: dict | None = None
    result: str | None = None
    answer: str | None = None


class Words:
    """Made-up words, real nouns and argument values of one split."""

    def __init__(self, rng: random.Random, split: str) -> None:
        self.rng, self.split = rng, split

    def _draw(self, make) -> str:
        while True:
            word = make()
            if split_of(word) == self.split:
                return word

    def madeup(self, syllables: tuple[int, int] = (2, 3)) -> str:
        rng = self.rng
        return self._draw(lambda: "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                                          for _ in range(rng.randint(*syllables))))

    def keyword(self) -> str:
        roll = self.rng.random()
        if roll < 0.45:
            return self.madeup()
        if roll < 0.7:
            return f"{self.madeup((1, 2))} {self._draw(lambda: self.rng.choice(REAL_NOUNS))}"
        return self._draw(lambda: self.rng.choice(REAL_NOUNS))

    def value(self, kind: str) -> str:
        rng = self.rng
        if kind == "place":
            return self.madeup().capitalize()
        if kind == "person":
            return f"{self.madeup((1, 2)).capitalize()} {self.madeup().capitalize()}"
        if kind == "number":
            return str(rng.randint(10, 99999))
        if kind == "code":
            return f"{''.join(rng.choices(string.ascii_uppercase, k=2))}-{rng.randint(10, 9999)}"
        if kind == "symbol":
            return "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 4)))
        if kind == "date":
            return f"20{rng.randint(10, 39)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if kind == "title":
            return f"The {self.madeup().capitalize()} {self.madeup().capitalize()}"
        return self.madeup()

    def result(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            return str(rng.randint(0, 9999))
        if roll < 0.45:
            return f"{rng.randint(0, 999)}.{rng.randint(0, 99)} {self.madeup((1, 2))}"
        if roll < 0.75:
            return self.madeup().capitalize()
        return self.madeup()


def make_tool(words: Words) -> MadeUpTool:
    """A made-up tool from one split's words (see the module docstring)."""
    rng = words.rng
    keyword = words.keyword()
    if rng.random() < 0.3:  # a made-up entity: the argument is a thing only this tool knows
        thing = words.madeup((1, 2))
        param = f"{thing}_id" if rng.random() < 0.5 else thing
        entity, kind = thing, rng.choice(("number", "word", "code"))
    else:
        param, entity, kind = rng.choice(ENTITIES)
    key = keyword.replace(" ", "_")
    if rng.random() < 0.15:
        name = f"{words.madeup()}_{words.madeup((1, 2))}" if rng.random() < 0.5 else words.madeup()
    else:
        name = rng.choice(NAME_FORMS).format(k=key, e=entity.replace(" ", "_"))
    prop = {"type": "string"}
    if rng.random() < 0.6:
        prop = {"description": rng.choice(PARAM_DESCRIPTIONS).format(e=entity), "type": "string"}
    properties = {param: prop}
    if rng.random() < 0.25:
        extra, type_, text = rng.choice(OPTIONAL_PARAMS)
        properties[extra] = {"description": text, "type": type_} if rng.random() < 0.5 else {"type": type_}
    schema = {"type": "function", "function": {
        "name": name, "description": rng.choice(DESCRIPTIONS).format(k=keyword, e=entity),
        "parameters": {"type": "object", "properties": properties, "required": [param],
                       "additionalProperties": False},
    }}
    return MadeUpTool(name, keyword, entity, param, kind, schema)


def make_tools(n: int, seed: int, split: str) -> list[MadeUpTool]:
    """``n`` made-up tools of one split with distinct names and keywords."""
    words = Words(random.Random(seed), split)
    tools: dict[str, MadeUpTool] = {}
    keywords: set[str] = set()
    while len(tools) < n:
        tool = make_tool(words)
        if tool.name not in tools and tool.keyword not in keywords:
            tools[tool.name] = tool
            keywords.add(tool.keyword)
    return list(tools.values())


def tool_episode(rng: random.Random, pool: list[MadeUpTool], words: Words) -> Episode:
    """A question one of 1-3 shown tools answers: call it, read its response, answer."""
    shown = rng.sample(pool, rng.choice((1, 2, 2, 3)))
    tool = shown[0]
    rng.shuffle(shown)
    value, result = words.value(tool.kind), words.result()
    question = rng.choice(QUESTIONS).format(k=tool.keyword, v=value)
    answer = rng.choice(ANSWERS).format(k=tool.keyword, v=value, r=result)
    arguments = {tool.param: value}
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    messages += [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": tool.name, "arguments": arguments}}]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]
    return Episode("tools", messages, [t.schema for t in shown], tool.name, arguments, result, answer)


def task_episode(rng: random.Random, task: str) -> Episode:
    """A built-in task's problem in chat form (see the module docstring)."""
    if task == "multiply":
        problem = Multiply().sample_problem(rng)
        arguments = {"expression": problem["expression"]}
        messages = [
            {"role": "user", "content": problem["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "calculator", "arguments": arguments}}]},
            {"role": "tool", "content": problem["answer"]},
            {"role": "assistant", "content": problem["answer"]},
        ]
        return Episode(task, messages, [CALCULATOR], "calculator", arguments, problem["answer"], problem["answer"])
    problem = {"addition": Addition, "reverse": Reverse, "repeat": Repeat}[task]().sample_problem(rng)
    messages = [{"role": "user", "content": problem["prompt"]}, {"role": "assistant", "content": problem["answer"]}]
    return Episode(task, messages, None, answer=problem["answer"])


# The training mix: shares of episodes by kind.
MIX = {"tools": 0.75, "multiply": 0.1, "addition": 0.07, "reverse": 0.04, "repeat": 0.04}
TRAIN_TOOLS = 4000
HELDOUT_TOOLS = 400


class Corpus:
    """The endless, seeded stream of training episodes (see MIX), over ``n_tools`` made-up tools
    (the same tools for every ``seed`` with the same ``tools_seed``)."""

    def __init__(self, seed: int, n_tools: int = TRAIN_TOOLS, tools_seed: int = 2) -> None:
        self.rng = random.Random(seed)
        self.words = Words(random.Random(seed + 1), "train")
        self.tools = make_tools(n_tools, tools_seed, "train")
        self.kinds, self.weights = list(MIX), list(MIX.values())

    def episode(self) -> Episode:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        if kind == "tools":
            return tool_episode(self.rng, self.tools, self.words)
        return task_episode(self.rng, kind)

    def episodes(self, n: int) -> list[Episode]:
        return [self.episode() for _ in range(n)]


def heldout_tools(seed: int, n: int = HELDOUT_TOOLS) -> list[MadeUpTool]:
    """The evaluation's tools: made from held-out words only."""
    return make_tools(n, seed, "heldout")


def heldout_episodes(n: int, seed: int) -> list[Episode]:
    """``n`` tool episodes over the held-out tools, with held-out argument values and results."""
    rng = random.Random(seed)
    words = Words(random.Random(seed + 1), "heldout")
    pool = heldout_tools(seed + 2)
    return [tool_episode(rng, pool, words) for _ in range(n)]


def fingerprint(episodes: list[Episode]) -> str:
    """A stable text of episodes, for determinism checks."""
    return json.dumps([(e.task, e.messages, e.tools) for e in episodes], sort_keys=True)
