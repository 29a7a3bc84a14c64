"""Speculative decoding (docs/architecture.md, "The ten ideas"): proposers draft tokens, the
target verifies them in one forward, the rejection sampler keeps the target distribution
exactly."""

from tokenbus.worker.spec_decode.metadata import SpecDecodeMetadata, expand_sampling_rows
from tokenbus.worker.spec_decode.proposer import Proposer, draft_cap, make_proposer
from tokenbus.worker.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler

__all__ = [
    "Proposer",
    "RejectionOutput",
    "RejectionSampler",
    "SpecDecodeMetadata",
    "draft_cap",
    "expand_sampling_rows",
    "make_proposer",
]
