"""Attention sources: where a scenario's attention comes from."""
