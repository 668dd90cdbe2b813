"""A tenant's project whose tools the base cannot call: warm-start it with SFT, then RL.

Two tools named and described the way people write them, with made-up words (the pretraining's
held-out split, ``marlaas.basemodel.synthetic.split_of``): the embedded base has never seen a name
like ``zorbleck_capital``, and at version 0 it almost never calls one right (docs/agentic.md has
the measured shares). The project's data:

- ``demos.jsonl``: 24 demonstrations (conversations: the question, the right call, the tool's
  result, the answer) for an ``sft`` job;
- ``prompts.jsonl``: 40 questions about *other* countries and planets, with their answers, for
  the ``agent`` job that starts from the sft job's last version (``init_from``) and learns by RL.

``python tools.py LOG [TENANT]`` serves both tools in the tenant's namespace (``acme`` unless
named; the job files here name ``default``'s, the embedded stack's tenant) and appends a line per
call to LOG: the tool's name, its argument, ``ok`` or ``error``. ``python tools.py --write-data
DIR`` writes the two JSONL files (they are committed beside this one). The chain, from this folder::

    python tools.py calls.log default &
    marlaas submit --then rl.toml sft.toml
"""

import json
import sys
import zlib
from pathlib import Path

from marlaas.tools import ToolError, serve, tool

COUNTRIES = ("Gizek", "Zarboum", "Vynchyr", "Bumchur", "Peaseas", "Chuporzu", "Gounzi", "Glome", "Resbry",
             "Boni", "Nangurski", "Brexkul", "Potryncheam", "Queaschunai", "Quuxgean", "Zezym", "Veasrain",
             "Mousveam", "Shyxkolque", "Staithor", "Lanskemfai", "Dukbaini", "Pykreas", "Reaxmos", "Thumbraix",
             "Krulbin", "Vamlou", "Koukrukskim", "Pleaxpouk", "Dirtou", "Skukeak", "Kroustim")
PLANETS = ("Dunmen", "Girbreamtu", "Trilras", "Staixplour", "Plealpe", "Nymthexplel", "Meakaim", "Cheazhas",
           "Keaxdrafim", "Skerzhushik", "Moka", "Skaimair", "Quaifamix", "Skaiskol", "Shixbai", "Gazhouk",
           "Shulzaixzou", "Vroulzhikbom", "Thouchokgem", "Thalthyr", "Kroplu", "Quaithealtan", "Glousskapleas",
           "Dordraxthoum", "Zakkair", "Rodoxskais", "Shemdri", "Zhezok", "Stoudaistok", "Rearbea", "Vizek",
           "Drostan")
CAPITALS = ("Quorrin", "Belvast", "Tirrun", "Oskel", "Marrow", "Pellin", "Drava", "Ustrin")
DEMOS_EACH = 12  # the first 12 countries and planets are demonstrated; RL asks about the other 20 of each
SYSTEM = "You answer questions with the tools. Call a tool, then answer with what it returns."
CAPITAL_QUESTIONS = ("What is the capital of {x}?", "Which city is the capital of {x}?")
MOON_QUESTIONS = ("How many moons does the planet {x} have?", "How many moons orbit {x}?")


def capital_of(country: str) -> str:
    return CAPITALS[zlib.crc32(country.encode()) % len(CAPITALS)] + str(zlib.crc32(country.encode()) % 10)


def moons_of(planet: str) -> str:
    return str(2 + zlib.crc32(planet.encode()) % 40)


def questions() -> list[dict]:
    """Every question of the project: its text, the tool and argument that answer it, the answer."""
    rows = []
    for i, (country, planet) in enumerate(zip(COUNTRIES, PLANETS, strict=True)):
        rows.append({"prompt": CAPITAL_QUESTIONS[i % 2].format(x=country), "answer": capital_of(country),
                     "tool": "zorbleck_capital", "arguments": {"country": country}})
        rows.append({"prompt": MOON_QUESTIONS[i % 2].format(x=planet), "answer": moons_of(planet),
                     "tool": "qelvin_moons", "arguments": {"planet": planet}})
    return rows


def demos() -> list[dict]:
    """The sft job's rows: a conversation per demonstrated question, the right call in it."""
    return [{"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": q["prompt"]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": q["tool"], "arguments": q["arguments"]}}]},
        {"role": "tool", "content": q["answer"]},
        {"role": "assistant", "content": q["answer"]}]} for q in questions()[:2 * DEMOS_EACH]]


def rl_prompts() -> list[dict]:
    """The RL job's rows: the questions no demonstration asks, with their answers."""
    return [{"prompt": q["prompt"], "answer": q["answer"]} for q in questions()[2 * DEMOS_EACH:]]


def logged(name: str, argument: str, ok: bool) -> None:
    with open(sys.argv[1], "a") as log:
        log.write(f"{name} {argument.replace(' ', '_')[:40] or '-'} {'ok' if ok else 'error'}\n")


@tool
def zorbleck_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name.
    """
    known = country in COUNTRIES
    logged("zorbleck_capital", country, known)
    if not known:
        raise ToolError(f"no country named {country!r}")
    return capital_of(country)


@tool
def qelvin_moons(planet: str) -> str:
    """Count the moons of a planet in the Qelvin catalogue.

    Args:
        planet: The planet's name.
    """
    known = planet in PLANETS
    logged("qelvin_moons", planet, known)
    if not known:
        raise ToolError(f"no planet named {planet!r} in the catalogue")
    return moons_of(planet)


def write_data(folder: Path) -> None:
    for name, rows in (("demos.jsonl", demos()), ("prompts.jsonl", rl_prompts())):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-data"]:
        write_data(Path(sys.argv[2]))
    else:
        serve(zorbleck_capital, qelvin_moons, tenant=sys.argv[2] if len(sys.argv) > 2 else "acme")
