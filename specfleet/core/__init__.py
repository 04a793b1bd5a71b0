"""Shared types every layer may import: the draft tree, the proposer protocol, statistics, the verifier."""
