"""Asynchronous mode: hooks, workers and transports, and the step-wide facts."""
