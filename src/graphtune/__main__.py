"""``python -m graphtune``: same as the ``graphtune`` command."""

import sys

from graphtune.cli.main import main

sys.exit(main())
