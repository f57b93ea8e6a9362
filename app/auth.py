"""Logins: the login form, logout, and who is asking.

Every page needs a logged-in user except `/login`, `/healthz`, `/metrics` (a token, or a loopback
client while no proxy is configured: `app.ops`) and the static files; the JSON API has its
bearer tokens instead (`app.api`). A user is remembered in Flask's signed session cookie by id
and a fingerprint of the password hash and the disabled state, so changing a password,
disabling or deleting the user ends its sessions at their next request. The OpenAI-compatible
API under /v1 takes the same bearer tokens (`app.openai`).
`g.user` is the user a request acts as: the session's on pages, the token's owner in the API.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Flask,
    g,
    jsonify,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask.typing import ResponseReturnValue
from flask_wtf import FlaskForm
from wtforms import HiddenField, PasswordField, StringField
from wtforms.validators import InputRequired, Length

from app.db import get_session
from app.forms import bad_utf8_fields
from models.tokens import check_token
from models.users import MAX_NAME, MAX_PASSWORD, User, authenticate

bp = Blueprint("auth", __name__)

# Endpoints anyone may reach; the API (its own tokens) is not listed but left alone too.
PUBLIC_ENDPOINTS = frozenset({"auth.login", "ops.healthz", "ops.metrics", "static"})


class LoginForm(FlaskForm):
    """User name and password, with Flask-WTF's CSRF token."""

    username = StringField("User name", validators=[InputRequired(), Length(max=MAX_NAME)])
    password = PasswordField("Password", validators=[InputRequired(), Length(max=MAX_PASSWORD)])
    next = HiddenField()


def init_app(app: Flask) -> None:
    """Load the session's user before every request, then send strangers to the login form."""
    app.before_request(load_user)
    app.before_request(require_login)


def _is_api() -> bool:
    return request.path.startswith(("/api/", "/v1/"))


def load_user() -> None:
    """Set `g.user` from the session cookie (None when there is no valid login)."""
    g.user = None
    user_id = session.get("user_id")
    if _is_api() or not isinstance(user_id, int):
        return
    user = get_session().get(User, user_id)
    if user is None or session.get("auth") != user.session_check:
        session.clear()  # the user is gone, disabled, or its password changed
        return
    g.user = user


def require_login() -> ResponseReturnValue | None:
    """Redirect to the login form unless logged in or on a public endpoint."""
    if g.user is not None or request.endpoint in PUBLIC_ENDPOINTS or _is_api():
        return None
    if request.endpoint == "jobs.progress":  # polled by script: an answer it understands
        return jsonify({"error": "not logged in"}), 401
    target = request.full_path if request.query_string else request.path
    if request.method not in ("GET", "HEAD"):
        target = None
    return redirect(url_for("auth.login", next=target))


def current_user() -> User:
    """The user this request acts as (pages and API alike)."""
    return g.user


def safe_next(target: str | None) -> str:
    """`target` when it is a path on this site, else the home page: no open redirects."""
    home = url_for("jobs.submit")
    if not target or not target.startswith("/") or target.startswith("//"):
        return home
    if "\\" in target or any(ord(c) < 32 or ord(c) == 127 for c in target):
        return home  # browsers read a backslash as a slash and drop tabs and newlines
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return home
    return target


def user_from_token() -> User | None:
    """The owner of the request's active bearer token (its last use recorded), else None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    row = check_token(get_session(), token.strip())
    if row is None:
        return None
    get_session().commit()
    g.api_token = row.name
    return row.user


def render_login(form: LoginForm, error: str | None = None, status: int = 200) -> tuple[str, int]:
    """The login page with `error` above the form."""
    return render_template("auth/login.html", form=form, error=error), status


@bp.route("/login", methods=("GET", "POST"))
def login():
    """The login form; on success, on to `next` (a local path) or the home page."""
    form = LoginForm(next=request.args.get("next", ""))
    if request.method == "GET":
        if g.user is not None:
            return redirect(safe_next(form.next.data))
        return render_login(form)
    if not form.validate_on_submit():
        return render_login(form, "Please fill in the fields marked below.", 400)
    user = None
    if not bad_utf8_fields() & {"username", "password"}:
        user = authenticate(get_session(), form.username.data, form.password.data)
    if user is None:
        form.password.data = ""
        return render_login(form, "Wrong user name or password.", 400)
    session.clear()  # a fresh session: nothing carried over from before the login
    session["user_id"] = user.id
    session["auth"] = user.session_check
    return redirect(safe_next(form.next.data))


@bp.post("/logout")
def logout():
    """End the session (POST with the CSRF token, so no other site can log anyone out)."""
    session.clear()
    return redirect(url_for("auth.login"))
