"""``kvevents registry start|stop|status|fetch``: a local schema registry (Apicurio, no Docker)."""

from __future__ import annotations

import argparse
import json
import sys

from kvevents.commands._common import CommandError, add_service_parser, command

DESCRIPTION = """\
Run a local schema registry: Apicurio Registry with its Confluent-compatible API, from Maven
Central, without Docker, bound to 127.0.0.1 (HTTP and management ports), storage in memory
(schemas are lost when it stops).

The first start fetches the registry (~160 MB) with 'mvn' into the cache (~/.cache/kvevents,
or $KVEVENTS_CACHE_DIR); it needs Java 21 or newer (found in $KVEVENTS_REGISTRY_JAVA,
$JAVA_HOME, PATH or /usr/lib/jvm). A start takes 15-30 s. State (pid, URL, registry.log) lives
in --data-dir, by default ./.kvevents/registry (or $KVEVENTS_REGISTRY_DIR).
Give the URL it prints to the Kafka commands: --schema-registry-url URL.
"""

EPILOG = """\
examples:
  kvevents registry start
  kvevents simulate --duration 10 --schema-registry-url "$(kvevents registry status --url)"
  kvevents registry stop
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``registry`` and its sub-commands."""
    add = add_service_parser(
        subparsers,
        "registry",
        help_text="start, stop or inspect a local schema registry (Apicurio, Confluent-compatible API)",
        description=DESCRIPTION,
        epilog=EPILOG,
        data_dir_help="the registry's state directory (default: $KVEVENTS_REGISTRY_DIR or ./.kvevents/registry)",
    )

    start = add("start", "start the registry in the background; return when it answers")
    start.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one)")
    start.add_argument(
        "--management-port", type=int, default=None, help="Quarkus management port (default: a free one)"
    )
    start.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for it to answer (default: 120)"
    )
    start.set_defaults(func=_start)
    stop = add("stop", "stop the registry: SIGTERM, then SIGKILL after 20 s")
    stop.set_defaults(func=_stop)
    status = add("status", "whether it runs, its pid and URL (exit 0 running, 3 stopped)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--url", action="store_true", help="print only the URL (for scripts)")
    status.set_defaults(func=_status)
    fetch = add("fetch", "download Apicurio Registry into the cache now (start does it when needed)")
    fetch.set_defaults(func=_fetch)


@command("registry start")
def _start(args: argparse.Namespace) -> int:
    from kvevents.registry import LocalRegistry, RegistryError, RegistryFetchError

    registry = LocalRegistry(
        args.data_dir, port=args.port, management_port=args.management_port, start_timeout=args.timeout
    )
    if not registry.status().running:
        print(
            f"starting Apicurio Registry in {registry.state_dir} (15-30 s; the first start also fetches "
            "~160 MB with mvn) ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        status = registry.start()
    except (RegistryError, RegistryFetchError) as exc:
        raise CommandError(str(exc)) from None
    took = "" if registry.last_start_seconds is None else f", started in {registry.last_start_seconds:.1f} s"
    print(
        f"schema registry running: {status.url}, pid {status.pid}{took}\n"
        f"  log: {status.log_file}\n  use: --schema-registry-url {status.url}"
    )
    return 0


@command("registry stop")
def _stop(args: argparse.Namespace) -> int:
    from kvevents.registry import LocalRegistry

    registry = LocalRegistry(args.data_dir)
    print("registry stopped" if registry.stop() else f"no registry was running in {registry.state_dir}")
    return 0


@command("registry status")
def _status(args: argparse.Namespace) -> int:
    from kvevents.registry import LocalRegistry
    from kvevents.registry.process import status_json

    status = LocalRegistry(args.data_dir).status(probe=True)
    if args.url:
        if status.url:
            print(status.url)
    elif args.json:
        print(json.dumps(status_json(status)))
    else:
        print(status.describe())
    return 0 if status.running else 3


@command("registry fetch")
def _fetch(args: argparse.Namespace) -> int:
    from kvevents.registry import RegistryFetchError, ensure_registry, find_registry_java

    print(
        "fetching Apicurio Registry with mvn unless it is cached (~160 MB) ...", file=sys.stderr, flush=True
    )
    try:
        dist = ensure_registry()
        java = find_registry_java()
    except RegistryFetchError as exc:
        raise CommandError(str(exc)) from None
    how = f"fetched in {dist.fetch_seconds:.1f} s" if dist.fetched_now else "already cached"
    print(f"Apicurio Registry {dist.version} in {dist.home} ({how}); java: {java}")
    return 0
