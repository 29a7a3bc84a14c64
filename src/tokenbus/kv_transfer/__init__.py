"""KV connectors (L2): move K/V blocks between this instance's paged pool and somewhere else
(files, a CPU/disk tier, another instance), for disaggregated prefill/decode and a KV cache
that outlives the pool.

Each connector has two halves: a scheduler half in the EngineCore (no torch; the Protocol is
core/sched/ports.KVConnectorScheduler) and a worker half beside the model runner
(base.KVConnectorWorker). They talk only through the step: the scheduler half's encoded
metadata rides in SchedulerOutput.kv_connector_metadata, the worker half's report in
ModelRunnerOutput.kv_connector_output. factory.py builds both from a KVTransferConfig.
"""
