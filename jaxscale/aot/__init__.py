"""Ahead-of-time compilation for TPU topologies on any machine: fit, cost, collectives, plans."""
