"""``python -m aggregator`` runs the coordinator (same as ``dpfed-aggregator``)."""

import sys

from aggregator.server_main import main

sys.exit(main())
