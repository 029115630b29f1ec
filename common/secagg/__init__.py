"""Secure aggregation: signed ephemeral keys, pairwise masks that cancel, fixed-point encoding.

With it the coordinator learns only the sum of the sites' contributions; the noise each site
adds (a share of Skellam noise, :mod:`dpfed.common.privacy.skellam`) is calibrated so that the
*sum* is differentially private for one row of the pooled data.
"""
