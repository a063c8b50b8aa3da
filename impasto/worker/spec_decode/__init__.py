"""Speculative decoding: proposers (n-gram, draft model) and the lossless rejection sampler."""

from impasto.worker.spec_decode.proposer import Proposer, StepResult
from impasto.worker.spec_decode.rejection_sampler import RejectionSampler

__all__ = ["Proposer", "RejectionSampler", "StepResult"]
