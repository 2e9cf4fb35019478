"""``python -m fedpeft`` is the ``fedpeft`` command."""

import sys

from fedpeft.cli import main

sys.exit(main())
