"""The privacy core: noise mechanisms, calibration, exact samplers, accounting, randomness.

Also the empirical-epsilon audit harness. This package imports no algorithm.
"""
