"""Behind a trusted reverse proxy (`TRUSTED_PROXIES`): the client's address is the forwarded
one, failed logins count per address and per account name at each address, and `/metrics`
takes a token only, since every client now comes from the proxy on this host."""

from __future__ import annotations

import pytest

from tests.factories import gen_user
from tests.web.conftest import log_in

PASSWORD = "a long enough secret"
PROXY = "127.0.0.1"  # a reverse proxy on this host, as docs/deploy.md sets it up


def through_proxy(app, client_address: str):
    """A test client whose requests come from the proxy, forwarded for `client_address`."""
    client = app.test_client()
    client.environ_base.update(
        REMOTE_ADDR=PROXY,
        HTTP_X_FORWARDED_FOR=client_address,
        HTTP_X_FORWARDED_PROTO="https",
        # As a browser sends it: over HTTPS the CSRF check wants a same-site Referer.
        HTTP_REFERER="https://localhost/login",
    )
    return client


@pytest.fixture
def users(session):
    return gen_user(session, "alice", PASSWORD), gen_user(session, "bob", PASSWORD)


def test_the_client_address_is_the_forwarded_one_only_when_configured(make_app):
    from flask import request

    seen = {}
    for hops in (0, 1):
        app = make_app(TRUSTED_PROXIES=hops)

        @app.after_request
        def note(response, hops=hops):
            seen[hops] = (request.remote_addr, request.scheme)
            return response

        through_proxy(app, "203.0.113.5").get("/healthz")
    assert seen[0] == (PROXY, "http")  # off by default: the headers are anyone's to send
    assert seen[1] == ("203.0.113.5", "https")


def test_bad_logins_through_one_proxy_lock_out_one_address_not_everyone(make_app, users):
    app = make_app(TRUSTED_PROXIES=1, LOGIN_RATE="3/minute", LOGIN_ACCOUNT_RATE="100/hour")
    attacker = through_proxy(app, "203.0.113.5")
    for _ in range(3):
        assert log_in(attacker, "alice", "wrong password").status_code == 400
    assert log_in(attacker, "bob", PASSWORD).status_code == 429  # that address is done
    # Bob, from his own address through the same proxy, is not.
    assert log_in(through_proxy(app, "198.51.100.7"), "bob", PASSWORD).status_code == 302


def test_one_accounts_failures_count_at_each_address_not_across_them(make_app, users):
    """Failures for one name from many addresses refuse each of those addresses once it is over
    its limit there, never the name's owner at an address of their own."""
    app = make_app(TRUSTED_PROXIES=1, LOGIN_RATE="100/minute", LOGIN_ACCOUNT_RATE="2/hour")
    guessers = [through_proxy(app, f"203.0.113.{10 + i}") for i in range(4)]
    for guesser in guessers:  # 8 failures for alice in all, 2 from each address
        for _ in range(2):
            assert log_in(guesser, "alice", "wrong password").status_code == 400
    for guesser in guessers:
        refused = log_in(guesser, "alice", PASSWORD)
        assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 3600
        assert "too many requests" in refused.get_data(as_text=True)
    assert log_in(through_proxy(app, "198.51.100.7"), "alice", PASSWORD).status_code == 302
    # Another account from any of those addresses is untouched.
    assert log_in(through_proxy(app, "203.0.113.10"), "bob", PASSWORD).status_code == 302


def test_successful_logins_use_up_no_allowance(make_app, users):
    app = make_app(LOGIN_RATE="2/minute", LOGIN_ACCOUNT_RATE="2/hour")
    for _ in range(4):
        assert log_in(app.test_client(), "alice", PASSWORD).status_code == 302


def test_metrics_behind_a_proxy_need_a_token(make_app, api_token):
    app = make_app(TRUSTED_PROXIES=1)
    for client in (app.test_client(), through_proxy(app, "127.0.0.1")):
        refused = client.get("/metrics")  # loopback, or claiming to be: not enough
        assert refused.status_code == 401
        assert "specpipe_jobs" not in refused.get_data(as_text=True)
        assert "client on this host" not in refused.get_data(as_text=True)
        good = client.get("/metrics", headers={"Authorization": f"Bearer {api_token}"})
        assert good.status_code == 200 and "specpipe_jobs" in good.get_data(as_text=True)


def test_trusted_proxies_setting(monkeypatch):
    from specpipe import settings

    assert settings.trusted_proxies() == 0 and settings.login_account_rate() == "20/hour"
    monkeypatch.setenv("SPECPIPE_TRUSTED_PROXIES", "2")
    assert settings.trusted_proxies() == 2
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("SPECPIPE_TRUSTED_PROXIES", bad)
        with pytest.raises(ValueError, match="SPECPIPE_TRUSTED_PROXIES must be"):
            settings.trusted_proxies()
