"""Connectors by name (L2): `kv_connector` in a KVTransferConfig picks both halves."""

from __future__ import annotations

import importlib

from tokenbus.config import KVTransferConfig
from tokenbus.kv_transfer.base import ConnectorContext, KVConnectorWorker, KVLayout

# name → (module, scheduler half, worker half); imported only when chosen.
CONNECTORS: dict[str, tuple[str, str, str]] = {
    "SharedStorageConnector": (
        "tokenbus.kv_transfer.shared_storage",
        "SharedStorageScheduler",
        "SharedStorageWorker",
    ),
    "OffloadingConnector": (
        "tokenbus.kv_transfer.offloading",
        "OffloadingScheduler",
        "OffloadingWorker",
    ),
    "P2PConnector": ("tokenbus.kv_transfer.p2p", "P2PScheduler", "P2PWorker"),
}


def _halves(name: str) -> tuple[type, type]:
    if name not in CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector: unknown connector {name!r}; "
            f"known: {sorted(CONNECTORS)}"
        )
    module_name, scheduler_name, worker_name = CONNECTORS[name]
    module = importlib.import_module(module_name)
    return getattr(module, scheduler_name), getattr(module, worker_name)


def connector_context(
    config: KVTransferConfig, layout: KVLayout, data_parallel_rank: int = 0
) -> ConnectorContext:
    """Data-parallel engines share one config: each gets its own engine id (and, P2P, port)."""
    engine_id = (
        config.engine_id
        if data_parallel_rank == 0
        else f"{config.engine_id}-dp{data_parallel_rank}"
    )
    return ConnectorContext(
        config=config, layout=layout, engine_id=engine_id, data_parallel_rank=data_parallel_rank
    )


def make_scheduler_connector(ctx: ConnectorContext):
    """The scheduler half (a core.sched.ports.KVConnectorScheduler)."""
    return _halves(ctx.config.kv_connector)[0](ctx)


def make_worker_connector(ctx: ConnectorContext) -> KVConnectorWorker:
    return _halves(ctx.config.kv_connector)[1](ctx)
