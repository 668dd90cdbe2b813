"""What every service process shares: config from ``--config``, logging, the bus, the store,
and shutdown as a protocol (SIGINT/SIGTERM set ``stop``; the service drains and returns, or
exits anyway once :data:`SHUTDOWN_GRACE_S` has passed), and a watchdog that reports an event
loop held past ``loop_block_warn_s``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from marlaas.platform.bus import Bus
from marlaas.platform.config import Config, load_config, read_config_json
from marlaas.platform.logs import setup_logging
from marlaas.platform.loop_watchdog import LoopWatchdog
from marlaas.platform.processes import SHUTDOWN_GRACE_S, end_own_group, exit_if_still_running_after
from marlaas.platform.store import ObjectStore, open_store


@dataclass
class Runtime:
    """A service's connections and its stop signal."""

    name: str
    config: Config
    bus: Bus
    store: ObjectStore | None  # None for a service run without the platform's data (the sandbox)
    stop: asyncio.Event

    def ready(self) -> None:
        """Tell the launcher this process is serving (a file ``run/ready/<name>-<pid>`` in home)."""
        marker = self.config.home_dir / "run" / "ready" / f"{self.name}-{os.getpid()}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def parse_config(name: str, argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    parser.add_argument("--config", help="a TOML config file, or the JSON written by `marlaas up`")
    args = parser.parse_args(argv)
    if args.config and args.config.endswith(".json"):
        config = read_config_json(Path(args.config).read_bytes())
        # a JSON config without a broker URL takes it from the environment: how the launcher hands
        # the sandbox its own credentials without writing them into a file
        if not config.nats_url and os.environ.get("MARLAAS_NATS_URL"):
            config = msgspec.structs.replace(config, nats_url=os.environ["MARLAAS_NATS_URL"])
        return config
    return load_config(args.config)


ServiceMain = Callable[[Runtime], Awaitable[None]]


def run_service(name: str, service: Callable[[], ServiceMain], argv: list[str] | None = None, *,
                platform: bool = True, inbox_prefix: str | None = None) -> None:
    """Entry point body: parse config, set up logging, then call ``service()`` (the entry point's
    own loader, which imports the heavy modules: torch, vLLM) and run the ``run`` it returns
    until SIGINT/SIGTERM. The platform never names a service's module: each hands its own.

    ``platform=False`` runs a service that holds none of the platform's data (the sandbox): it
    neither creates the streams and buckets nor opens the object store (its broker user may not
    reach JetStream, and it has no store credentials); ``inbox_prefix`` is its user's reply prefix.
    """
    config = parse_config(name, argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    log = setup_logging(name, config.log_format, config.log_level)
    if not config.nats_url:
        raise SystemExit(f"{name}: nats_url is not set (use `marlaas up`, or set MARLAAS_NATS_URL)")
    main = service()

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if not stop.is_set():
                stop.set()
                exit_if_still_running_after(SHUTDOWN_GRACE_S)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        bus = await Bus.connect(config.nats_url, name=name, inbox_prefix=inbox_prefix)
        store = None
        if platform:
            await bus.ensure_topology(duplicate_window_s=config.duplicate_window_s, replicas=config.nats_replicas)
            store = open_store(config.resolved_store_url)
        runtime = Runtime(name, config, bus, store, stop)
        watchdog = LoopWatchdog(loop, config.loop_block_warn_s, name).start()
        try:
            await main(runtime)
        finally:
            watchdog.stop()
            await bus.close()
            log.info("stopped")

    try:
        asyncio.run(amain())
    finally:
        end_own_group()  # no child (a vLLM engine core) outlives the service
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End a service that stopped cleanly now: its work is drained, its broker connection closed
    and its children gone, so what interpreter shutdown would still do (collect the garbage of
    torch's and vLLM's modules: 1.5-2 s of CPU in rollout, measured) changes nothing. The logs
    are flushed first. A service is always a process of its own (``python -m services.X``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
