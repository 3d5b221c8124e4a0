"""Structured output: JSON and JSON-schema constraints as a byte-level automaton."""
