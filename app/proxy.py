"""Trusted reverse proxies: with `TRUSTED_PROXIES` (`SPECPIPE_TRUSTED_PROXIES`) hops in front of
the app, the client's address, scheme and host come from their `X-Forwarded-*` headers
(werkzeug's ProxyFix); with none, the default, those headers are ignored, so no client can claim
another address by sending them."""

from __future__ import annotations

from flask import Flask, current_app
from werkzeug.middleware.proxy_fix import ProxyFix


def init_app(app: Flask) -> None:
    """Read the forwarded headers of `TRUSTED_PROXIES` hops, when that is more than 0."""
    hops = app.config["TRUSTED_PROXIES"]
    if hops:
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops)


def behind_proxy() -> bool:
    """Whether the app is configured to sit behind a reverse proxy: then every connection
    comes from the proxy, and a loopback peer says nothing about who the client is."""
    return current_app.config["TRUSTED_PROXIES"] > 0
