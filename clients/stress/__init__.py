"""Stress tool: abuse matrix, field-level fuzzing and soak against a running server (python -m clients.stress)."""
