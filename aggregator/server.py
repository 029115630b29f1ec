"""Assemble and run the coordinator's gRPC server.

``grpc.aio`` server with mutual TLS (client certificates required), the SiteLink and Analyst
services, the standard ``grpc.health.v1`` health service (SERVING only once the store is open
and unfinished jobs are resumed) and server reflection (so ``grpcurl`` can explore it).
SIGTERM/SIGINT stop it gracefully: health goes NOT_SERVING, running jobs are cancelled (they
stay 'running' in the store and resume at the next start), streams close so sites reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dpfed.aggregator.access_control import AccessControl, JobAccess
from dpfed.aggregator.config import AggregatorConfig
from dpfed.aggregator.federation import Federation
from dpfed.aggregator.orchestrator import JobManager
from dpfed.aggregator.planning import Planner
from dpfed.aggregator.registry import SiteRegistry
from dpfed.aggregator.servicers import AnalystServicer, Authenticator, SiteLinkServicer
from dpfed.aggregator.store import JobStore
from dpfed.common.data.schema import Schema
from dpfed.common.metrics import MetricsServer, serve_metrics
from dpfed.common.pb.v1 import analyst_pb2, analyst_pb2_grpc, site_link_pb2, site_link_pb2_grpc
from dpfed.common.transport.grpc_options import server_options
from dpfed.common.transport.tls import load_server_credentials
from dpfed.common.warm_imports import import_job_libraries

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


@dataclass
class RunningCoordinator:
    """Handles to a started coordinator (used by the binary and by tests)."""

    server: grpc.aio.Server
    port: int
    store: JobStore
    registry: SiteRegistry
    jobs: JobManager
    health: health.aio.HealthServicer
    access_watch: asyncio.Task[None] | None = None
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    metrics_server: MetricsServer | None = None
    #: The planner's workers starting in the background (awaited at stop).
    planner_warm_up: asyncio.Task[None] | None = None

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Graceful stop: NOT_SERVING, cancel jobs, close streams, stop the server."""
        if self.access_watch is not None:
            self.access_watch.cancel()
        await self.health.enter_graceful_shutdown()
        if self.planner_warm_up is not None:
            await asyncio.gather(self.planner_warm_up, return_exceptions=True)
        await self.jobs.shutdown()
        self.registry.close_all("coordinator shutting down")
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.metrics_server is not None:
            await self.metrics_server.close()
        self.store.close()


async def _warm_up(planner: Planner) -> None:
    """Start the planning workers and import the jobs' libraries, both off the event loop."""
    await asyncio.gather(asyncio.to_thread(planner.warm_up),
                         asyncio.to_thread(import_job_libraries))


async def start_coordinator(config: AggregatorConfig) -> RunningCoordinator:
    """Open the store, bind the port, start serving, resume unfinished jobs."""
    schema = Schema.load(config.schema_path)
    federation = Federation(schema, min_sites=config.min_sites,
                            task_deadline_s=config.task_deadline_s,
                            resume_wait_s=config.resume_wait_s)
    access = AccessControl(access_list=config.access_list, sites=config.allowed_sites,
                           analysts=config.allowed_analysts,
                           allow_any_site=config.allow_any_site,
                           allow_any_analyst=config.allow_any_analyst)
    store = JobStore(config.store_path)
    registry = SiteRegistry()
    registry.metrics.watch(registry, store)
    jobs = JobManager(store, registry, federation)
    auth = Authenticator(insecure=config.tls is None, access=access)

    server = grpc.aio.server(options=server_options(config.keepalive_s))
    site_link = SiteLinkServicer(registry, store, federation, auth)
    site_link_pb2_grpc.add_SiteLinkServicer_to_server(site_link, server)
    analyst_pb2_grpc.add_AnalystServicer_to_server(
        AnalystServicer(registry, store, jobs, federation, auth,
                        JobAccess(groups=config.read_groups, admins=config.admins)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = (
        site_link_pb2.DESCRIPTOR.services_by_name["SiteLink"].full_name,
        analyst_pb2.DESCRIPTOR.services_by_name["Analyst"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(service_names, server)
    for name in ("", *service_names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    if config.tls is None:
        log.warning("[Coordinator.start] --insecure: no TLS, identities are NOT verified; "
                    "never use this outside a development machine")
        port = server.add_insecure_port(config.listen)
    else:
        creds = load_server_credentials(config.tls.ca, config.tls.cert, config.tls.key)
        port = server.add_secure_port(config.listen, creds)
    if port == 0:
        store.close()
        raise OSError(f"cannot listen on {config.listen}")
    await server.start()
    health_server = metrics_server = None
    try:
        health_server, health_port = await _start_health_port(config, health_servicer)
        metrics_server = await serve_metrics(config.metrics, registry.metrics.registry,
                                             "coordinator")
    except OSError:
        await server.stop(0)
        if health_server is not None:
            await health_server.stop(0)
        store.close()
        raise
    warming = asyncio.create_task(_warm_up(jobs.planner))  # in the background
    resumed = await jobs.resume_unfinished()
    for name in ("", *service_names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("[Coordinator.start] listening on %s (port %d), schema %s..., store %s, "
             "%d job(s) resumed", config.listen, port, schema.digest()[:12], config.store_path,
             resumed)
    watch = asyncio.create_task(_watch_access(access, site_link, config.access_reload_s))
    return RunningCoordinator(server, port, store, registry, jobs, health_servicer, watch,
                              health_server, health_port, metrics_server, warming)


async def _watch_access(access: AccessControl, site_link: SiteLinkServicer,
                        interval_s: float) -> None:
    """Re-read the access file when it changes and drop the sessions it now refuses.

    Live sessions are checked at every tick, not only when this loop saw the file change: a
    new connection may have read the change first.
    """
    while True:
        await asyncio.sleep(interval_s)
        try:
            access.reload()
            closed = site_link.enforce_access()
            if closed:
                log.info("[Coordinator.access] %d session(s) dropped by the access list", closed)
        except Exception:  # noqa: BLE001 -- the watcher must outlive any one bad reload
            log.exception("[Coordinator.access] checking the access list failed")
async def _start_health_port(config: AggregatorConfig, servicer: health.aio.HealthServicer,
                             ) -> tuple[grpc.aio.Server | None, int | None]:
    """Serve the health service alone, without TLS, on ``server.health_listen`` (if set).

    It answers only ``grpc.health.v1.Health`` (SERVING / NOT_SERVING): no identity, data or
    job information, so a container or load-balancer probe needs no certificate. Bind it to
    loopback or a private network, never to the public interface.
    """
    if config.health_listen is None:
        return None, None
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(config.health_listen)
    if port == 0:
        raise OSError(f"cannot listen on server.health_listen {config.health_listen}")
    await server.start()
    log.info("[Coordinator.start] plaintext health probe on %s (port %d)",
             config.health_listen, port)
    return server, port


async def serve(config: AggregatorConfig) -> None:
    """Run until SIGTERM/SIGINT."""
    running = await start_coordinator(config)
    if config.port_file is not None:
        tmp = config.port_file.with_suffix(".tmp")
        tmp.write_text(f"{running.port}\n")
        tmp.replace(config.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("[Coordinator.serve] stopping")
    await running.stop()
