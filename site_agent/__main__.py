"""``python -m dpfed.site_agent`` runs the site agent (same as ``dpfed-site``)."""

import sys

from dpfed.site_agent.cli import main

sys.exit(main())
