"""``python -m gateway`` is ``orchid-gateway``."""

import sys

from gateway.cli import main

sys.exit(main())
