"""Test and benchmark harness (synthetic worlds, oracles, upstream code runners)."""
