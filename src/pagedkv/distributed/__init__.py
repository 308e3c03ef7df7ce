"""Distributed execution: process groups and collectives (torch.distributed)."""
