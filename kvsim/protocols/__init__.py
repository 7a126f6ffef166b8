"""Protocols: when a policy compresses, and with which queries (DESIGN section 9)."""
