"""Pinned host expert store, GPU expert cache, weight bytes for the memory planner."""
