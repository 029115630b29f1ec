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
    Both ends send HTTP/2 pings every half ``keepalive_s`` and drop the connection when a ping
    is not answered within the other half, so a dead or hung peer (a crashed host, a stopped
    process, a dead NAT mapping) is noticed within ``keepalive_s`` seconds
    (``DEFAULT_KEEPALIVE_S``; ``[server] keepalive_s`` in aggregator.toml, ``[coordinator]
    keepalive_s`` in site.toml). The server accepts pings as often as once a second and never
    answers them with GOAWAY "too_many_pings" (grpc/doc/keepalive.md), so the two settings
    need not agree.
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
MAX_TRANSFER_BYTES = 1 << 30

#: Default seconds within which a silent peer is declared gone (pings every half of it).
DEFAULT_KEEPALIVE_S = 10.0
#: Smallest and largest keepalive accepted in a config file (seconds).
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 3600.0

#: Default per-call timeout of unary analyst calls (seconds).
DEFAULT_RPC_TIMEOUT_S = 30.0

Options = list[tuple[str, int | str]]


def _common(keepalive_s: float) -> Options:
    half_ms = max(500, int(keepalive_s * 500))
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        # gRPC core >= 1.5x times an unanswered ping out after grpc.http2.ping_timeout_ms
        # (default one minute) whatever keepalive_timeout_ms says: set both.
        ("grpc.http2.ping_timeout_ms", half_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Options:
    """Options for the coordinator's server (pings each site every ``keepalive_s / 2``)."""
    return _common(keepalive_s) + [
        # Accept the clients' keepalive pings whatever their own keepalive_s.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(server_name: str | None = None,
                    keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Options:
    """Options for channels from sites and analysts to the coordinator.

    ``server_name`` overrides the TLS name checked against the coordinator's certificate
    (useful when dialling an IP address that is not in the certificate).
    """
    opts = _common(keepalive_s) + [
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    return opts
