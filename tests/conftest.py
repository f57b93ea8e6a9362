"""Shared pytest fixtures."""

pytest_plugins = ["tests.dbfixtures"]
