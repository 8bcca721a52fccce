"""``python -m flexoff``: the ``flexoff`` command."""

import sys

from .commands.main import main

sys.exit(main())
