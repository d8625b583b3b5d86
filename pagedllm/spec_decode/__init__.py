"""Speculative decoding: proposers behind one interface (see proposer.py); verification is in sample/."""

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.factory import build_proposer
from pagedllm.spec_decode.proposer import ProposeContext, Proposer

__all__ = ["ProposeContext", "Proposer", "SpeculativeConfig", "build_proposer"]
