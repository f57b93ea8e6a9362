"""Tests of the store-backed web app: pages, forms, API, CLI and a real browser."""
