"""Pinned host expert store, GPU expert cache, memory planner."""
