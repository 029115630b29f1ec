"""Shared, network-free core of dpfed.

Schema, data sources, differential-privacy mechanisms and their calibration, privacy
accounting, linear algebra, link functions, metrics, the wire format, and TLS tooling.
``common`` never imports ``site_agent`` or ``aggregator``.
"""

