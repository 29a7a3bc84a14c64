"""Speculative-decoding counters reach /metrics, including acceptance per draft position."""

from prometheus_client import CollectorRegistry, generate_latest

from tokenbus.api.openai.metrics import PrometheusStatLogger
from tokenbus.protocol import SchedulerStats


def test_spec_decode_counters_exported_per_position():
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger(registry, "m", max_model_len=128)
    stats = SchedulerStats(
        spec_num_drafts=2,
        spec_num_draft_tokens=8,
        spec_num_accepted_tokens=5,
        spec_accepted_per_pos=[2, 2, 1],
    )
    stat_logger.record(stats, None)
    stat_logger.record(stats, None)
    text = generate_latest(registry).decode()
    assert 'tokenbus:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0' in text
    assert 'tokenbus:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0' in text
    per_pos = (
        "tokenbus:spec_decode_num_accepted_tokens_per_pos_total"
        '{engine="0",model_name="m",position="2"} 2.0'
    )
    assert per_pos in text
