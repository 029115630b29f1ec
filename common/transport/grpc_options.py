"""Every gRPC channel and server option dpfed uses, in one place, for both sides.

Message size
    gRPC's default receive limit is 4 MiB (a p x p float64 matrix passes only for p <= 724).
    dpfed never relies on a raised limit for big payloads: tasks, results and result files are
    split into chunks of ``CHUNK_BYTES`` (``dpfed.common.transport.wire.iter_chunks``) and
    reassembled under
    ``MAX_TRANSFER_BYTES``. The per-message limit is raised to ``MAX_MESSAGE_BYTES`` only to
    leave headroom for a chunk plus its envelope; a larger message fails with
    RESOURCE_EXHAUSTED instead of hanging.
Keepalive
    The site pings every ``KEEPALIVE_TIME_MS`` so a coordinator restart or a dead NAT mapping is
    noticed within about a minute; the server is told to accept pings that often (otherwise it
    answers GOAWAY "too_many_pings", see grpc/doc/keepalive.md), and pings idle sites itself.
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
MAX_TRANSFER_BYTES = 1 << 30

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000

#: Default per-call timeout of unary analyst calls (seconds).
DEFAULT_RPC_TIMEOUT_S = 30.0

Options = list[tuple[str, int | str]]


def _common() -> Options:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> Options:
    """Options for the coordinator's server."""
    return _common() + [
        # Accept the clients' keepalive pings (they ping every KEEPALIVE_TIME_MS).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 3),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(server_name: str | None = None) -> Options:
    """Options for channels from sites and analysts to the coordinator.

    ``server_name`` overrides the TLS name checked against the coordinator's certificate
    (useful when dialling an IP address that is not in the certificate).
    """
    opts = _common() + [
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return opts
