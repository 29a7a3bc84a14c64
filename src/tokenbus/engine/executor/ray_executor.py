"""RayExecutor: tensor-parallel ranks as Ray actors in one placement group (L4).

For ranks on several machines: Ray places the actors (one bundle per rank, packed), and the
ranks join one torch.distributed group at rank 0's node address. The executor attaches to an
existing cluster (`--ray-address`, else $RAY_ADDRESS) or starts a local one on 127.0.0.1.

What crosses to an actor is ours, encoded: each step's SchedulerOutput and each RPC go as
msgpack bytes (the same RpcCall/StepCall frames as the multi-process executor) and come back
as a msgpack WorkerReply; Ray only moves the bytes. (Ray pickles the actor's constructor
arguments, the frozen configs, once at start-up, as multiprocessing's spawn does.)

A dead actor is noticed by the next call (Ray raises ActorDiedError there), and by
check_health, which pings every rank.

Loopback: a local cluster, and the driver's side of an attach to a loopback address, are kept
on 127.0.0.1 (`ray_on_loopback`). A cluster to attach to on this machine must be started on
loopback too, and a driver attaching by address uses the cluster's token only when told to:

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address=127.0.0.1 --port=6379
    RAY_AUTH_MODE=token tokenbus serve --distributed-executor-backend ray \
        --ray-address 127.0.0.1:6379
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import msgspec

from tokenbus.config import EngineConfig
from tokenbus.core.outputs import ModelRunnerOutput
from tokenbus.core.sched.output import SchedulerOutput
from tokenbus.engine.executor.abstract import Executor
from tokenbus.engine.executor.multiproc import (
    CALL_TIMEOUT_S,
    READY_TIMEOUT_S,
    RpcCall,
    StepCall,
    WorkerCall,
    WorkerFailedError,
    WorkerReply,
    dispatch_call,
    encode_reply,
    reply_error,
)
from tokenbus.model_arch import ModelArch
from tokenbus.utils.cpu import available_cpus

if TYPE_CHECKING:
    from tokenbus.loader import ModelSource

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 3.0
HEALTH_TIMEOUT_S = 10.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray: pip install 'tokenbus[ray]'"
        ) from None
    return ray


def check_ray_address(address: str) -> None:
    """A clear start-up error for a cluster that cannot be reached ("auto" is Ray's own lookup)."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"ray_address {address!r}: cannot reach a Ray cluster there ({exc})"
        ) from None


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (host:port) names this machine's loopback."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def ray_on_loopback():
    """Within: ray.init keeps 127.0.0.1 as this node's address.

    Why forced: on Linux Ray 2.60 replaces 127.0.0.1 (in `_node_ip_address`, `--node-ip-address`
    and the address it is given to attach to) with the machine's routed address and advertises
    that, so "127.0.0.1" alone still sends Ray's traffic to eth0's address. Ray has a loopback-only
    mode, its default on macOS and Windows: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes the node's
    address 127.0.0.1, which its servers then also bind (not 0.0.0.0). The variable is read by the
    processes ray.init starts, and by `ray._private.ray_constants` when Ray is first imported,
    which in this process has already happened: both are set, and put back afterwards (the nodes
    keep their environment). Only for a local cluster or a loopback address: a node of a
    multi-machine cluster must advertise its network address.
    """
    from ray._private import ray_constants

    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[variable], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved_env


class RayWorkerActor:
    """One rank inside a Ray actor: the Worker, driven by encoded calls."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        arch: ModelArch,
        eos_token_id: int | None,
        rank: int,
    ) -> None:
        logging.basicConfig(
            level=logging.INFO,
            format=f"(RayWorker rank={rank} pid=%(process)d) %(levelname)s %(name)s: %(message)s",
        )
        self.rank = rank
        self.config, self.source, self.arch, self.eos_token_id = config, source, arch, eos_token_id
        self.worker: Any = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerCall)

    def rendezvous(self) -> str:
        """tcp://<this node>:<a free port>: where the ranks meet (asked of rank 0)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return f"tcp://{host}:{sock.getsockname()[1]}"

    def start(self, init_method: str) -> bytes:
        """Build the Worker and run its device and model phases; an encoded WorkerReply."""
        from tokenbus.worker.worker import Worker

        try:
            # Ray shows an actor only the GPU it was given: that is device 0 in here.
            self.worker = Worker(
                self.config,
                self.source,
                self.arch,
                self.eos_token_id,
                rank=self.rank,
                distributed_init_method=init_method,
                local_device_index=0,
            )
            self.worker.init_device()
            self.worker.load_model()
        except Exception as exc:
            logger.exception("rank %d failed to start", self.rank)
            return encode_reply(self._encoder, self.rank, exc=exc)
        return encode_reply(self._encoder, self.rank)

    def handle(self, frame: bytes) -> bytes:
        """One encoded call → one encoded WorkerReply (a step's value is None off rank 0)."""
        try:
            value = dispatch_call(self.worker, self._decoder.decode(frame))
        except Exception as exc:
            logger.exception("rank %d: call failed", self.rank)
            return encode_reply(self._encoder, self.rank, exc=exc)
        return encode_reply(self._encoder, self.rank, value)

    def ping(self) -> int:
        return self.rank

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(Executor):
    def __init__(
        self, config: EngineConfig, source: ModelSource, arch: ModelArch, eos_token_id: int | None
    ) -> None:
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self.world_size = config.parallel.world_size
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._started_ray = False
        self._actors: list[Any] = []
        self._pg = None
        self._closed = False
        self._connect(config.parallel.ray_address or os.environ.get("RAY_ADDRESS"))
        try:
            on_cuda = config.model.device.startswith("cuda") or (
                config.model.device == "auto" and _has_cuda()
            )
            # One bundle per rank, packed onto as few nodes as possible; on CPU a rank asks for
            # its share of this node's cores (fractions let 3 ranks share 2 cores).
            cpus = 1.0 if on_cuda else min(1.0, available_cpus() / self.world_size)
            bundle = {"CPU": cpus, "GPU": 1.0} if on_cuda else {"CPU": cpus}
            self._pg = placement_group(
                [dict(bundle) for _ in range(self.world_size)], strategy="PACK"
            )
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            actor_class = ray.remote(RayWorkerActor)
            self._actors = [
                actor_class.options(
                    num_cpus=cpus,
                    num_gpus=1.0 if on_cuda else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i),
                ).remote(config, source, arch, eos_token_id, i)
                for i in range(self.world_size)
            ]
            init_method = ray.get(self._actors[0].rendezvous.remote(), timeout=PLACEMENT_TIMEOUT_S)
            self._check(
                self._get(
                    [actor.start.remote(init_method) for actor in self._actors], READY_TIMEOUT_S
                )
            )
        except BaseException:
            self.shutdown()
            raise

    def _connect(self, address: str | None) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        # No usage reports leave this machine.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address:
            check_ray_address(address)
            with ray_on_loopback() if is_loopback_address(address) else contextlib.nullcontext():
                ray.init(address=address, log_to_driver=True)
        else:
            # "local": a new cluster, even where `ray start` left an address in /tmp/ray.
            with ray_on_loopback():
                ray.init(
                    address="local",
                    num_cpus=available_cpus(),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    log_to_driver=True,
                )
        self._started_ray = True

    # ------------------------------------------------------------------ Executor
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if kwargs:
            raise ValueError("collective_rpc: the Ray executor takes positional args only")
        replies = self._call_all(RpcCall(method, list(args)))
        return [msgspec.msgpack.decode(reply.value) for reply in replies]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._call_all(StepCall(scheduler_output))
        return self._output_decoder.decode(replies[0].value)

    def check_health(self) -> None:
        try:
            self._ray.get([actor.ping.remote() for actor in self._actors], timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise WorkerFailedError(f"a Ray worker is unhealthy: {exc}") from exc

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=5)
            except Exception:
                pass
            ray.kill(actor)
        if self._pg is not None:
            try:
                self._remove_placement_group(self._pg)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()

    # ------------------------------------------------------------------ plumbing
    def _call_all(self, call: RpcCall | StepCall) -> list[WorkerReply]:
        frame = self._encoder.encode(call)  # once: Ray puts the bytes in its object store
        return self._check(
            self._get([actor.handle.remote(frame) for actor in self._actors], CALL_TIMEOUT_S)
        )

    def _get(self, refs: list[Any], timeout_s: float) -> list[bytes]:
        """Every rank's encoded reply; a dead or silent rank is a WorkerFailedError, and a rank's
        error reply is raised as soon as it arrives (its peers may be stuck in a collective)."""
        ray = self._ray
        pending, done = list(refs), {}
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                ready, pending = ray.wait(
                    pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
                )
                if not ready:
                    raise WorkerFailedError(
                        f"Ray workers did not answer within {timeout_s:.0f} s (hung)"
                    )
                reply = ray.get(ready[0])
                if self._reply_decoder.decode(reply).error is not None:
                    self._check([reply])
                done[ready[0]] = reply
        except ray.exceptions.RayActorError as exc:
            raise WorkerFailedError(f"a Ray worker died: {exc}") from exc
        return [done[ref] for ref in refs]

    def _check(self, raw: list[bytes]) -> list[WorkerReply]:
        replies = [self._reply_decoder.decode(r) for r in raw]
        for reply in replies:
            if reply.error is not None:
                raise reply_error(reply)
        return replies


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
