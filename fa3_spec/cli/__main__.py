"""``python3 -m fa3_spec.cli``: the ``fa3-spec`` command."""

import sys

from . import main

sys.exit(main())
