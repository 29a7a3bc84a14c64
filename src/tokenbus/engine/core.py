"""EngineCore: the step loop — schedule → execute → update (L4).

It knows nothing of text: token ids in, token ids out. The same object runs in-process (tests,
offline) or inside its own process behind ZMQ.
"""

from __future__ import annotations

import time

from tokenbus.config import EngineConfig, ModelArch
from tokenbus.core.kv import KVCacheManager
from tokenbus.core.request import Request, RequestStatus
from tokenbus.core.kv import make_block_hasher
from tokenbus.core.sched.scheduler import Scheduler
from tokenbus.loader import ModelSource
from tokenbus.protocol import EngineOutputs, EngineRequest
from tokenbus.worker.worker import Worker


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ModelArch,
                 eos_token_id: int | None) -> None:
        self.config = config
        self.worker = Worker(config, source, arch, eos_token_id)
        block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(self.worker.num_blocks, block_size,
                                               enable_caching=config.cache.enable_prefix_caching)
        self._block_hasher = make_block_hasher(block_size) if config.cache.enable_prefix_caching else None
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_blocks

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(Request.from_engine_request(request, self._block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineOutputs(timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                             timestamp=time.monotonic())

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
