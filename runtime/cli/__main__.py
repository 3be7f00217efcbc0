"""``python -m runtime.cli``: the ``tierstore`` command."""

import sys

from runtime.cli.main import main

sys.exit(main())
