"""Scheduler, model runner, engine loop thread, offline LLM API."""
