"""``python -m orchid_tools`` is ``orchid-gateway``."""

import sys

from orchid_tools.cli import main

sys.exit(main())
