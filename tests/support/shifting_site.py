"""A hostile site agent for the tests: it shifts its secure contributions.

Run as a real process in place of ``python -m dpfed.site_agent`` (same arguments): the real
site agent, whose secure-aggregation handler adds :data:`SHIFT` to the first entry of its
exact integer statistic before its noise and masks -- what a malicious participant can do to
a secure sum, which the masks hide from everyone.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np

from dpfed.common.secagg.masking import MaskContext
from dpfed.common.secagg.secure_sum import SecureSumPlan
from dpfed.site_agent.handlers import secagg

#: What the site adds to the first entry (the 2^50 of the hostile review).
SHIFT = 2 ** 50


class ShiftingHandler(secagg.SecureAggregationHandler):
    """The ``secagg`` handler, with its statistic shifted before it is noised and masked."""

    def masked(self, statistic: np.ndarray, plan: SecureSumPlan, state: secagg.SumState,
               publics: Mapping[str, bytes], context: MaskContext,
               rng: np.random.Generator) -> np.ndarray:
        shifted = np.array(statistic, dtype=np.int64)
        shifted[0] += SHIFT
        return super().masked(shifted, plan, state, publics, context, rng)


def main(argv: list[str] | None = None) -> int:
    """Start the real site agent with the shifting handler."""
    secagg.SecureAggregationHandler = ShiftingHandler  # type: ignore[misc]
    from dpfed.site_agent.cli import main as site_main

    return site_main(argv)


if __name__ == "__main__":
    sys.exit(main())
