"""Shared test helpers (fixtures' building blocks) for tests across packages."""
