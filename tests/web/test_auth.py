"""Logins: the form and its bad input, CSRF, `next`, logout, which pages need a login, who may
read /metrics, and the login rate limit."""

from __future__ import annotations

import pytest

from models.users import User
from tests.factories import gen_user
from tests.web.conftest import Api, as_user, csrf_token, log_in

PASSWORD = "a long enough secret"


@pytest.fixture
def alice(session) -> User:
    return gen_user(session, "alice", PASSWORD)


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/history",
        "/jobs/1",
        "/jobs/1/progress",
        "/proofs/",
        "/proofs/1",
        "/nodes/",
        "/runs/1/record.json",
        "/proofs/plots/1/tv.png",
        "/no/such/page",
    ],
)
def test_pages_need_a_login(anon, path):
    response = anon.get(path)
    if path.endswith("/progress"):  # polled by the job page's script
        assert response.status_code == 401 and response.is_json
        return
    assert response.status_code == 302
    assert response.headers["Location"] == f"/login?next={path}"


def test_posts_need_a_login(anon, session, queue):
    token = csrf_token(anon, "/login")
    for path in ("/", "/jobs/1/cancel", "/jobs/1/rerun"):
        response = anon.post(path, data={"csrf_token": token, "prompt": "hi"})
        assert response.status_code == 302 and response.headers["Location"] == "/login"
    assert queue.messages() == []


@pytest.mark.parametrize("path", ["/healthz", "/static/style.css", "/api/v1/openapi.json"])
def test_public_paths(anon, path):
    assert anon.get(path).status_code == 200


def test_log_in_then_out(anon, alice):
    page = anon.get("/login").get_data(as_text=True)
    assert 'name="username"' in page and 'name="password"' in page and "csrf_token" in page
    response = log_in(anon, "alice", PASSWORD)
    assert response.status_code == 302 and response.headers["Location"] == "/"
    home = anon.get("/").get_data(as_text=True)
    assert 'id="whoami">alice' in home
    assert anon.get("/login").status_code == 302  # already logged in
    response = anon.post("/logout", data={"csrf_token": csrf_token(anon)})
    assert response.status_code == 302 and response.headers["Location"] == "/login"
    assert anon.get("/history").status_code == 302


def test_session_cookie_flags(anon, alice):
    cookie = log_in(anon, "alice", PASSWORD).headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie


def test_session_cookie_secure_over_https(make_app, session, alice):
    app = make_app(SESSION_COOKIE_SECURE=True)
    client = app.test_client()
    cookie = log_in(client, "alice", PASSWORD).headers["Set-Cookie"]
    assert "Secure" in cookie
    assert "Strict-Transport-Security" in client.get("/healthz").headers


def test_https_setting(monkeypatch):
    from specpipe import settings

    monkeypatch.delenv("SPECPIPE_HTTPS", raising=False)
    assert settings.https() is False
    monkeypatch.setenv("SPECPIPE_HTTPS", "1")
    assert settings.https() is True


@pytest.mark.parametrize(
    ("username", "password", "message"),
    [
        ("alice", "wrong password", "Wrong user name or password."),
        ("nobody", PASSWORD, "Wrong user name or password."),
        ("", PASSWORD, "User name: This field is required."),
        ("alice", "", "Password: This field is required."),
        ("a" * 101, PASSWORD, "User name: Field cannot be longer than 100 characters."),
        ("al\x00ice", PASSWORD, "Wrong user name or password."),
        ("alice'; --", PASSWORD, "Wrong user name or password."),
        ("ALICE", PASSWORD, "Wrong user name or password."),
    ],
)
def test_bad_logins_rerender_with_errors(anon, alice, username, password, message):
    response = log_in(anon, username, password)
    assert response.status_code == 400
    html = response.get_data(as_text=True)
    assert message in html and 'name="username"' in html
    assert PASSWORD not in html  # the password is never sent back
    assert anon.get("/history").status_code == 302


def test_invalid_utf8_login_refused(anon, alice):
    token = csrf_token(anon, "/login")
    body = f"csrf_token={token}&username=alice&password=%FF%FE".encode()
    response = anon.post("/login", data=body, content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400


def test_a_user_without_a_password_cannot_log_in(anon, admin):
    assert not admin.has_password
    assert log_in(anon, "admin", "").status_code == 400
    assert log_in(anon, "admin", "anything at all").status_code == 400


def test_login_needs_csrf(anon, alice):
    anon.get("/login")
    response = anon.post("/login", data={"username": "alice", "password": PASSWORD})
    assert response.status_code == 400 and "CSRF" in response.get_data(as_text=True)
    forged = {"username": "alice", "password": PASSWORD, "csrf_token": "forged"}
    assert anon.post("/login", data=forged).status_code == 400
    assert anon.get("/history").status_code == 302


def test_logout_needs_a_post_with_csrf(anon, alice):
    log_in(anon, "alice", PASSWORD)
    assert anon.get("/logout").status_code == 405
    assert anon.post("/logout").status_code == 400
    assert anon.get("/history").status_code == 200


@pytest.mark.parametrize(
    ("target", "landing"),
    [
        ("/history?status=done", "/history?status=done"),
        ("/jobs/3", "/jobs/3"),
        ("https://evil.example/", "/"),
        ("//evil.example/", "/"),
        ("/\\evil.example", "/"),
        ("\\\\evil.example", "/"),
        ("/\t/evil.example", "/"),
        ("javascript:alert(1)", "/"),
        ("http:/evil.example", "/"),
        ("", "/"),
    ],
)
def test_next_is_a_local_path_only(anon, alice, target, landing):
    response = log_in(anon, "alice", PASSWORD, next=target)
    assert response.status_code == 302 and response.headers["Location"] == landing


def test_next_carried_from_the_redirect_to_the_form(anon, alice):
    location = anon.get("/history?q=x").headers["Location"]
    form = anon.get(location).get_data(as_text=True)
    assert 'value="/history?q=x"' in form
    response = log_in(anon, "alice", PASSWORD, next="/history?q=x")
    assert response.headers["Location"] == "/history?q=x"


def test_password_change_ends_sessions(anon, session, alice):
    log_in(anon, "alice", PASSWORD)
    assert anon.get("/history").status_code == 200
    alice.set_password("another long secret")
    session.commit()
    assert anon.get("/history").status_code == 302


def test_deleted_user_is_logged_out(anon, session, alice):
    from models.user_deletion import delete_user

    as_user(anon, alice)
    assert anon.get("/history").status_code == 200
    delete_user(session, "alice")
    session.commit()
    assert anon.get("/history").status_code == 302


def test_disabled_user_is_logged_out_and_refused(anon, session, alice):
    from models.accounts import disable_user, enable_user

    as_user(anon, alice)
    assert anon.get("/history").status_code == 200
    disable_user(session, alice)
    session.commit()
    assert anon.get("/history").status_code == 302  # at its next request
    refused = log_in(anon, "alice", PASSWORD)
    assert refused.status_code == 400  # answered as a wrong password, not "disabled"
    html = refused.get_data(as_text=True)
    assert "Wrong user name or password." in html and "disabled" not in html.lower()
    assert anon.get("/history").status_code == 302
    enable_user(session, alice)
    session.commit()
    assert log_in(anon, "alice", PASSWORD).status_code == 302
    assert anon.get("/history").status_code == 200


def test_a_disabled_users_token_gets_401(anon, session, alice):
    from models.db import utcnow
    from models.tokens import create_token

    api = Api(anon, create_token(session, "alice-ci", alice))
    session.commit()
    assert api.get("/jobs").status_code == 200
    assert anon.get("/v1/models", headers=api.headers).status_code == 200
    alice.disabled_at = utcnow()  # disabled without its tokens being revoked
    session.commit()
    assert api.get("/jobs").status_code == 401
    assert anon.get("/v1/models", headers=api.headers).status_code == 401


def test_login_attempts_rate_limited(make_app, session, alice):
    app = make_app(LOGIN_RATE="3/minute")
    client = app.test_client()
    for _ in range(3):
        assert log_in(client, "alice", "wrong password").status_code == 400
    response = log_in(client, "alice", PASSWORD)  # even the right password, for now
    assert response.status_code == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    html = response.get_data(as_text=True)
    assert "too many requests" in html and 'name="password"' in html
    assert client.get("/history").status_code == 302
    other = app.test_client()  # the same address, with a fresh session: still limited
    assert log_in(other, "alice", PASSWORD).status_code == 429
    assert log_in(from_address(app, "198.51.100.7"), "alice", PASSWORD).status_code == 302


def from_address(app, address: str):
    """A test client whose requests come from `address`."""
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = address
    return client


@pytest.mark.parametrize(
    ("address_rate", "account_rate"),
    [("100/minute", "3/hour"), ("3/minute", "3/hour"), ("3/minute", "100/hour")],
)
def test_a_stranger_cannot_lock_a_user_out(make_app, session, alice, address_rate, account_rate):
    app = make_app(LOGIN_RATE=address_rate, LOGIN_ACCOUNT_RATE=account_rate)
    stranger = from_address(app, "203.0.113.9")
    for _ in range(3):
        assert log_in(stranger, "alice", "wrong password").status_code == 400
    refused = log_in(stranger, "alice", PASSWORD)  # even the right password, at that address
    assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 3600
    # A fresh session from the same address is refused too; the owner at theirs is not.
    assert log_in(from_address(app, "203.0.113.9"), "alice", "wrong password").status_code == 429
    assert log_in(from_address(app, "198.51.100.7"), "alice", PASSWORD).status_code == 302


def test_login_limits_are_shared_through_the_locked_down_redis_of_up(make_app, session, alice):
    """Two web processes on the Redis `specpipe up` runs (password, ACL) count attempts
    together: the limits' scripts run under the swarm user, not in a per-process fallback."""
    from specpipe.ops.redis_server import RedisServer

    with RedisServer(password="correct horse") as locked:
        shared = {
            "REDIS_URL": locked.url,
            "LOGIN_RATE": "2/minute",
            "RATELIMIT_KEY_PREFIX": "test-locked-limits",
        }
        first, second = make_app(**shared).test_client(), make_app(**shared).test_client()
        assert log_in(first, "alice", "wrong password").status_code == 400
        assert log_in(second, "alice", "wrong password").status_code == 400
        assert log_in(first, "alice", PASSWORD).status_code == 429
        assert log_in(second, "alice", PASSWORD).status_code == 429


def test_metrics_for_loopback_or_token_only(anon, api_token):
    assert anon.get("/metrics").status_code == 200  # the test client is 127.0.0.1
    outside = {"REMOTE_ADDR": "203.0.113.9"}
    refused = anon.get("/metrics", environ_base=outside)
    assert refused.status_code == 401 and "specpipe_jobs" not in refused.get_data(as_text=True)
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    bad = {"Authorization": "Bearer sp_nope"}
    assert anon.get("/metrics", environ_base=outside, headers=bad).status_code == 401
    good = {"Authorization": f"Bearer {api_token}"}
    response = anon.get("/metrics", environ_base=outside, headers=good)
    assert response.status_code == 200 and "specpipe_jobs" in response.get_data(as_text=True)
    ipv6 = anon.get("/metrics", environ_base={"REMOTE_ADDR": "::1"})
    assert ipv6.status_code == 200
