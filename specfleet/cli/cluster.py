"""`specfleet cluster`: N replicas of `specfleet serve` behind the SGLang Model Gateway's cache-aware router.

    specfleet cluster --replicas 2 --threads-per-replica 1 --port 8000 -- --model smollm2-135m-instruct

Everything after `--` is given to each replica's `specfleet serve` (model, draft, KV budget, API key
...). Replicas on other machines (each started there with `specfleet serve --host 0.0.0.0 ...`) join
with `--worker http://HOST:PORT`; `--replicas 0 --worker ... --worker ...` runs the router alone.
Needs `pip install 'specfleet[cluster]'` (the router, a Rust binary in a wheel). docs/cluster.md.
"""
from __future__ import annotations

import argparse
import logging
import signal


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from specfleet.cluster.launcher import POLICIES

    p = subparsers.add_parser(
        "cluster", help="scale out: N `serve` replicas (here, or elsewhere by URL) behind a cache-aware router",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="replicas started on this machine (default 2)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a replica already running elsewhere (http://HOST:PORT); repeat for several")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="the router's port: the one endpoint clients use")
    p.add_argument("--replica-host", default="127.0.0.1",
                   help="address the local replicas listen on (0.0.0.0 if a router on another machine uses them)")
    p.add_argument("--replica-port", type=int, default=None,
                   help="first local replica's port; the others follow (default: --port + 1)")
    p.add_argument("--threads-per-replica", type=int, default=None,
                   help="OMP_NUM_THREADS of each local replica (give cores / replicas; default: inherited)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="the router's policy (cache_aware: a conversation's turns go where its prefix is cached)")
    p.add_argument("--router-metrics-port", type=int, default=None,
                   help="the router's own Prometheus port (default: the port after the last replica's)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more flag for the router (smg launch), e.g. --router-arg=--cache-threshold=0.5")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a local replica that exits unexpectedly (it rejoins the router)")
    p.add_argument("--log-dir", default=None, help="replica and router logs (default: a new temporary folder)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for replicas and router")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: the arguments of each replica's `specfleet serve` (see specfleet serve --help)")
    p.set_defaults(func=run_cluster)
    return p


def config_from_args(args: argparse.Namespace):
    from specfleet.cli.serve import add_serve_args
    from specfleet.cluster.launcher import ClusterConfig
    from specfleet.errors import SpecfleetError

    serve_args = list(args.serve_args)
    if serve_args and serve_args[0] == "--":
        serve_args = serve_args[1:]
    check = argparse.ArgumentParser(prog="specfleet serve", add_help=False, exit_on_error=False)
    add_serve_args(check)
    try:  # a bad replica argument fails here, once, not in N replicas' logs
        _, unknown = check.parse_known_args(serve_args)
    except argparse.ArgumentError as e:
        raise SpecfleetError(f"replica arguments (after --): {e}") from e
    if unknown:
        raise SpecfleetError(f"replica arguments (after --) that `specfleet serve` does not know: {' '.join(unknown)}")
    return ClusterConfig(
        replicas=args.replicas, serve_args=serve_args, workers=args.worker, host=args.host, port=args.port,
        replica_host=args.replica_host, replica_port=args.replica_port, threads_per_replica=args.threads_per_replica,
        policy=args.policy, router_metrics_port=args.router_metrics_port, router_args=args.router_arg,
        restart=args.restart, ready_timeout_s=args.ready_timeout, log_dir=args.log_dir)


def run_cluster(args: argparse.Namespace) -> int:
    from specfleet.cluster.launcher import Cluster

    logging.getLogger("specfleet.cluster").setLevel(logging.INFO)
    cluster = Cluster(config_from_args(args))
    print(f"specfleet: starting {len(cluster.replicas)} replica(s) (logs in {cluster.log_dir})", flush=True)
    stop = lambda *_: cluster.stop()  # noqa: E731 -- SIGTERM / Ctrl-C: router, then the replicas' drain
    signal.signal(signal.SIGTERM, stop)
    cluster.start()
    signal.signal(signal.SIGINT, stop)
    workers = ", ".join(cluster.worker_urls)
    print(f"specfleet: router ({args.policy}) on {cluster.url} over {workers}", flush=True)
    status = cluster.supervise()
    print("specfleet: cluster stopped", flush=True)
    return status
