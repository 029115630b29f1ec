"""Job kinds as one contract: rounds shared by coordinator and sites, one registry.

docs/architecture.md ("Adding a job kind") describes the contract; the kinds live in
:mod:`dpfed.common.jobs.registry`.
"""
