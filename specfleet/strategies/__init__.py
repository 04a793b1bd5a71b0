"""Strategies over draft sources: the spec grammar and factory, voting, selection, adaptive length, the fleet."""
