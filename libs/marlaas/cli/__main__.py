"""``python -m marlaas.cli.commands``: the ``marlaas`` command."""

import sys

from marlaas.cli.commands import main

sys.exit(main())
