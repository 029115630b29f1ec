"""Default certificate lifetimes.

Kept apart from ``certs`` so command lines can show them without loading the cryptography
library.
"""

from __future__ import annotations

#: Lifetime of an issued site, analyst or coordinator certificate, in days.
DEFAULT_VALIDITY_DAYS = 365
#: Lifetime of the federation CA, in days.
DEFAULT_CA_VALIDITY_DAYS = 3650
