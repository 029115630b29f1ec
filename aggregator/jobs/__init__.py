"""The coordinator side of the job kinds: the dispatcher and each kind's run.

:mod:`dpfed.aggregator.jobs.job` runs rounds (site-level or as secure sums,
:mod:`dpfed.aggregator.jobs.secure_rounds`); ``pca``, ``query``, ``svt`` and ``synth`` hold
each kind's run, named by its descriptor in :mod:`dpfed.common.jobs.registry`.
"""
