"""The Ray cluster a run uses: starting or joining it (`init_ray`, which reuses a cluster `ray start --head`
runs on this machine), and how its clients are grouped onto client hosts (`plan_hosts`), for the inline
backend, the Ray backend and Tune's trial reservations alike.

Light on purpose (Ray is imported only inside `init_ray`), so the sweep front door can use it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

from raysim.config import RunConfig
from raysim.errors import ConfigError, shown

log = logging.getLogger(__name__)

# Ray 2.60 logs this (a WARNING) every time it turns token authentication on for this process
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


def assign_clients(num_clients: int, num_hosts: int) -> list[list[int]]:
    """Client c lives on host c mod H for the whole run (pooled placement)."""
    return [[c for c in range(num_clients) if c % num_hosts == h] for h in range(num_hosts)]


def plan_hosts(cfg: RunConfig, cluster_cpus: float, cluster_gpus: float) -> list[list[int]]:
    """The client groups, one per client host (a ClientActor, or a ClientHost in this process for
    backend=inline); client c is in group c mod H.

    H is num_clients with placement=actor_per_client, else num_actors; num_actors=0 means as many client
    actors as the cluster has room for next to the server (`client_cpus` each, and `client_gpus` each when
    the cluster has GPUs), and one host for backend=inline, which runs them all in this process. H is at
    least 1 and at most num_clients."""
    if cfg.execution.placement == "actor_per_client":
        hosts = cfg.train.num_clients
    elif cfg.execution.num_actors > 0:
        hosts = cfg.execution.num_actors
    elif cfg.execution.backend == "inline":
        hosts = 1
    else:
        client_gpus = cfg.execution.client_gpus if cluster_gpus > 0 else 0.0  # no GPU: the actors run on CPU
        x = cfg.execution
        by_cpu = int((cluster_cpus - x.server_cpus) // x.client_cpus) if x.client_cpus > 0 else cfg.train.num_clients
        by_gpu = int(cluster_gpus // client_gpus) if client_gpus > 0 else cfg.train.num_clients
        hosts = max(1, min(by_cpu, by_gpu))
    return assign_clients(cfg.train.num_clients, min(hosts, cfg.train.num_clients))


class _DropAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(AUTH_NOTICE)


@contextlib.contextmanager
def _quiet_auth_notice() -> Iterator[None]:
    """While Ray starts: drop its "Token authentication is enabled for this Ray cluster. Set
    RAY_AUTH_MODE=disabled to opt out." notice. Ray 2.60 turns token authentication on (when RAY_AUTH_MODE
    is unset) for every local cluster it starts, creating ~/.ray/auth_token if needed, and for
    address=auto when such a token exists; it is the safe default for a private cluster and asks nothing
    of the user, so raysim does not repeat it on every run. Every other message of Ray's (the warning that
    authentication is *disabled*, errors) passes."""
    logger = logging.getLogger(AUTH_LOGGER)
    quiet = _DropAuthNotice()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


# A local cluster raysim starts runs only actors (client and server hosts, Tune trials), each in a worker
# process of its own; the Python workers Ray prestarts (one per CPU, for tasks) are never used by them and only
# compete with the actors' start-up (imports, model builds) for the CPUs (benchmarks/startup.py).
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def running_local_cluster() -> str:
    """The GCS address of the cluster `ray start --head` runs on this machine (the address Ray records in
    its ray_current_cluster file, with a GCS process alive at it), or "" when none is up."""
    try:
        from ray._private import services

        recorded = services.find_bootstrap_address(None)
        return recorded if recorded and recorded in services.find_gcs_addresses() else ""
    except Exception:  # private Ray API: any change there just means no reuse
        return ""


LOOPBACK = "127.0.0.1"  # where a cluster raysim starts itself listens (docs/security.md)
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes the node's address to be loopback
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"  # Ray reports cluster usage to its servers unless this is "0"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """While a local cluster starts: Ray 2.60's ray.init turns a node address of 127.0.0.1 into the machine's
    reachable address unless it is told the cluster is single-machine (its switch for that is the environment
    variable LOCAL_ONLY_ENV, read into ray_constants.ENABLE_RAY_CLUSTER). Both are set for the start only; the
    processes started meanwhile inherit the variable, so they too take loopback as the node's address.

    Ray's usage-stats report (sent from the dashboard's head process, which Ray runs even with the dashboard
    off) is turned off for the cluster too, unless the user set RAY_USAGE_STATS_ENABLED: nothing about a
    private run leaves the machine by default."""
    if USAGE_STATS_ENV not in os.environ:
        os.environ[USAGE_STATS_ENV] = "0"  # inherited by the cluster's processes; kept for this driver's life
    try:
        from ray._private import ray_constants
    except Exception:  # private Ray API: without it Ray picks the address itself
        yield
        return
    old_env, old_flag = os.environ.get(LOCAL_ONLY_ENV), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = old_env


PROBE_SECONDS = 5.0  # how long a cluster's head may take to accept a TCP connection before ray.init is tried


def head_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of an explicit cluster address (HOST:PORT, [IPv6]:PORT, ray://HOST:PORT), None for the
    addresses Ray resolves itself ("", "local", "auto"). A malformed one is a ConfigError naming it."""
    if address in ("", "local", "auto"):
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"execution.address={shown(address)} is not HOST:PORT (e.g. 192.168.1.5:6379), auto or local")
    return host, int(port)


def probe_head(address: str, *, timeout: float = PROBE_SECONDS, what: str = "execution.address") -> None:
    """A TCP connection to the head of `address` within `timeout` seconds, before ray.init: ray.init itself
    waits without end on an address where nothing answers (a stopped cluster, a wrong or unroutable host).
    Nothing answering is a ConfigError naming the address."""
    import socket

    endpoint = head_endpoint(address)
    if endpoint is None:
        return
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            pass
    except OSError as e:  # refused, timed out, no route, unknown host
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise ConfigError(
            f"{what}={shown(address)}: no Ray cluster answers at {endpoint[0]}:{endpoint[1]} within {timeout:g} s "
            f"({why}); start the cluster (ray start --head), or fix execution.address (auto on a node of the cluster, "
            "else HOST:PORT of its head; empty: a local cluster)"
        ) from None


def init_ray(address: str = "", *, num_cpus: int | None = None, log_to_driver: bool = True, dashboard: bool = False) -> bool:
    """Join or start Ray. `address` "" joins the cluster `ray start --head` runs on this machine when one
    is up (or RAY_ADDRESS's, when set), else starts a local cluster with `num_cpus` (default: every core
    here); "local" (or an explicit `num_cpus`) always starts a new local cluster; "auto" or HOST:PORT joins
    that cluster. Returns True when this call started or joined Ray (the caller shuts it down when done:
    for a joined cluster that only disconnects), False when Ray was already up in this process.

    A cluster that cannot be reached (a wrong address, or one that wants a token this driver lacks) ends
    with one ConfigError saying what to check, not Ray's traceback."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(include_dashboard=False, configure_logging=False, log_to_driver=log_to_driver)
    found = "" if address or num_cpus is not None else os.environ.get("RAY_ADDRESS", "") or running_local_cluster()
    with _quiet_auth_notice():
        if found:  # as Ray finds it (RAY_ADDRESS, else the recorded local cluster, whose token Ray then uses)
            log.info("joining the running Ray cluster at %s (execution.address=local starts a new one)", found)
            if os.environ.get("RAY_ADDRESS"):
                probe_head(found, what="RAY_ADDRESS")
            try:
                ray.init(**kwargs)
                return True
            except ConnectionError as e:
                if os.environ.get("RAY_ADDRESS"):
                    raise ConfigError(f"could not connect to the Ray cluster at RAY_ADDRESS={found} ({e}); unset RAY_ADDRESS "
                                      "or fix it (with token authentication: RAY_AUTH_MODE=token, see clusters/README.md)") from None
                log.warning("could not join the local Ray cluster at %s (%s); starting a new one", found, e)
        if not address or address == "local":
            system = dict(LOCAL_SYSTEM_CONFIG)  # a copy: Ray writes into the dict it gets
            # private: every process of the cluster binds to loopback only (Ray's control plane runs code for
            # whoever reaches it); the dashboard stays off unless execution.dashboard asks for it (on loopback too)
            kwargs["include_dashboard"] = bool(dashboard)
            with _loopback_node():
                ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), _system_config=system,
                         _node_ip_address=LOOPBACK, **kwargs)
            from raysim.engine.reaper import start_reaper

            start_reaper()  # the cluster's processes end with this driver, even on kill -9 (raysim/engine/reaper.py)
            return True
        probe_head(address)
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            raise ConfigError(
                f"could not connect to the Ray cluster at address={address} ({e}). Check the address (auto on a "
                "node of the cluster, else HOST:PORT of its head); if the cluster uses token authentication, give "
                "this driver its token too: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token), see "
                "clusters/README.md"
            ) from None
    return True
