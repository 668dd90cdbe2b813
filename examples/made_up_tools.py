"""Two tools the chat base has never seen, served by a tenant's own process (as a user would).

``python made_up_tools.py LOG`` serves ``get_mutrol`` and ``tashom_lookup`` in the namespace
``acme`` and appends one line per call (the tool's name) to LOG. Their names, keywords
("mutrol", "tashom") and the cities are made-up words of the pretraining's *held-out* split
(``marlaas.basemodel.synthetic.split_of``): they appear nowhere in its training data.

``get_mutrol`` knows the mutrol of :data:`CITIES` only (any other argument is an error), so a
successful call is the right tool with the right argument; ``tashom_lookup`` takes a user id
(digits) and fails on anything else. A question about a city's mutrol needs the first.
"""

import sys
import zlib

from marlaas.tools import ToolError, serve, tool

KEYWORDS = ("mutrol", "tashom")
CITIES = ("Qualis", "Krarstyx", "Treldrik", "Vrinvril", "Skulla", "Choba", "Drubrex", "Stytrean", "Suktrum",
          "Fetryn", "Cheakra", "Nakthu", "Drykro", "Vabil", "Deatys", "Saisbou", "Vizek", "Drostan", "Bouze",
          "Plovy", "Kouglyk", "Pylchitrais", "Brekchouk", "Gousvron")
QUESTIONS = ("What is the mutrol of {c}?", "Find the mutrol for {c}.", "I need the mutrol of {c}.",
             "Look up the mutrol of {c}.")


def mutrol_of(city: str) -> str:
    return str(100 + zlib.crc32(city.encode()) % 900)


def dataset_rows() -> list[dict]:
    """One question per city (the templates in turn); the answer is the tool's result."""
    return [{"prompt": QUESTIONS[i % len(QUESTIONS)].format(c=c), "answer": mutrol_of(c), "city": c}
            for i, c in enumerate(CITIES)]


def logged(name: str) -> None:
    with open(sys.argv[1], "a") as log:
        log.write(name + "\n")


@tool
def get_mutrol(city: str) -> str:
    """Look up the mutrol of a city.

    Args:
        city: The city.
    """
    logged("get_mutrol")
    if city not in CITIES:
        raise ToolError(f"no mutrol known for {city!r}")
    return mutrol_of(city)


@tool
def tashom_lookup(user_id: str) -> str:
    """Returns the tashom for the given user.

    Args:
        user_id: The user.
    """
    logged("tashom_lookup")
    if not user_id.isdigit():
        raise ToolError(f"{user_id!r} is not a user id (digits)")
    return str(zlib.crc32(user_id.encode()) % 97)


if __name__ == "__main__":
    serve(get_mutrol, tashom_lookup, tenant="acme")
