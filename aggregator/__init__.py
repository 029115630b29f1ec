"""The coordinator.

gRPC server, site registry, job orchestration and store, the analyst CLI and Python API.
"""
