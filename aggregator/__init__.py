"""The coordinator: gRPC server, site registry, job orchestration and store, analyst CLI and API."""
