"""dpfed: federated differential privacy for hospital consortia.

The distribution installs one top-level package, ``dpfed``, with three subpackages whose
sources live at the top of the repository:

- :mod:`dpfed.common` -- the network-free core (privacy mechanisms and accounting, DP-PCA,
  synthesis, queries, evaluation, data, transport);
- :mod:`dpfed.site_agent` -- the hospital-side process (``dpfed-site``);
- :mod:`dpfed.aggregator` -- the coordinator (``dpfed-aggregator``), the analyst CLI
  (``dpfed``) and the Python API.
"""

__version__ = "0.1.0"
