"""Prefect flows: thin wiring of tasks around the pipetune study engine."""
