"""``python -m site_agent`` runs the site agent (same as ``dpfed-site``)."""

import sys

from site_agent.cli import main

sys.exit(main())
