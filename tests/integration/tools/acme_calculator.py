"""A tenant's own tool, run as its own process next to the stack (as a user would).

``python acme_calculator.py LOG`` serves ``calculator`` in the namespace ``acme`` and
appends one line per call to LOG, so a test can see it was called.
"""

import sys

from marlaas.tools import serve, tool

LOG = sys.argv[1]


@tool
def calculator(expression: str) -> str:
    """Multiply: 'a*b' -> the product."""
    with open(LOG, "a") as log:
        log.write(expression + "\n")
    a, b = expression.split("*")
    return str(int(a) * int(b))


if __name__ == "__main__":
    serve(calculator, tenant="acme")
