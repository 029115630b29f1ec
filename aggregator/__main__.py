"""``python -m dpfed.aggregator`` runs the coordinator (same as ``dpfed-aggregator``)."""

import sys

from dpfed.aggregator.server_main import main

sys.exit(main())
