"""``tuneplane-coordinator user``: who may call the API, and their tokens.

Rules: a user's token is printed once and stored only hashed; listing users never shows a
token, only when it expires or was revoked.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import attrs
import click

from ..auth import USER_PREFIX, CredentialLife, hash_credential, new_credential
from ..clock import now_ms
from ..config import load_config
from ..store import identity as store_identity
from ..store.core import Store
from ..store.users import create_user, users
from ..values.users import User
from .admin_common import (
    NAME_PATTERN,
    parse_ttl,
    run,
    run_sync,
    state_dir_option,
    with_store,
)


@click.group(name="user")
def user() -> None:
    """Users: who may call the API. Each has a token; Jobs record the user who committed them."""


_expires_in_option = click.option(
    "--expires-in",
    default=None,
    help="How long the token works: 30m, 12h, 90d, or never (default: coordinator.toml's "
    "[credentials] user_token_lifetime, 90d unless set).",
)


@user.command(name="create")
@click.argument("name")
@state_dir_option
@click.option("--admin", "is_admin", is_flag=True, help="May cordon, uncordon and drain Nodes.")
@_expires_in_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the token.")
def user_create(
    name: str, state_dir: Path, is_admin: bool, expires_in: str | None, as_json: bool
) -> None:
    """Create the user NAME and print their token (shown once, stored only hashed)."""
    if not NAME_PATTERN.match(name):
        raise click.BadParameter(
            f"{name!r} is not a user name: use 1-63 lowercase letters, digits, '.', '_' or '-'.",
            param_hint="NAME",
        )
    secret = new_credential(USER_PREFIX)
    role = "admin" if is_admin else "researcher"
    now = now_ms()
    expires = _token_expiry(state_dir, expires_in, now)

    async def work(store: Store) -> None:
        await create_user(store, name, hash_credential(secret), role, now, expires)

    run(with_store, state_dir, work)
    _print_token(name, role, secret, expires, as_json)


def _token_expiry(state_dir: Path, expires_in: str | None, now: int) -> int | None:
    """When a new user token expires: ``--expires-in``, else coordinator.toml's lifetime."""
    if expires_in == "never":
        return None
    if expires_in is None:
        seconds = run_sync(load_config, state_dir).user_token_lifetime_s
    else:
        seconds = parse_ttl(expires_in, "--expires-in")
    return now + seconds * 1000


def _print_token(name: str, role: str, secret: str, expires: int | None, as_json: bool) -> None:
    if as_json:
        click.echo(
            json.dumps(
                {"user": name, "role": role, "token": secret, "expires_at_ms": expires},
                sort_keys=True,
            )
        )
    else:
        click.echo(secret)


@user.command(name="token")
@click.argument("name")
@state_dir_option
@_expires_in_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the token.")
def user_token(name: str, state_dir: Path, expires_in: str | None, as_json: bool) -> None:
    """Give the user NAME a new token (printed once); their old token stops working at once."""
    secret = new_credential(USER_PREFIX)
    now = now_ms()
    expires = _token_expiry(state_dir, expires_in, now)

    async def work(store: Store) -> str:
        await store_identity.issue_user_token(
            store, name, hash_credential(secret), expires, "admin CLI", now
        )
        return next(u.role for u in await users(store) if u.name == name)

    role = run(with_store, state_dir, work)
    _print_token(name, role, secret, expires, as_json)


@user.command(name="revoke")
@click.argument("name")
@state_dir_option
def user_revoke(name: str, state_dir: Path) -> None:
    """Revoke the user NAME's token: every call with it is refused from the next one on."""

    async def work(store: Store) -> bool:
        return await store_identity.revoke_user(store, name, "admin CLI", now_ms())

    changed = run(with_store, state_dir, work)
    if changed:
        click.echo(
            f"Revoked the token of user {name}. Give them a new one with "
            f"`tuneplane-coordinator user token {name}`."
        )
    else:
        click.echo(f"The token of user {name} was already revoked; nothing changed.")


@user.command(name="ls")
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def user_ls(state_dir: Path, as_json: bool) -> None:
    """List users, their roles and their tokens' expiry or revocation (never the tokens)."""

    async def work(store: Store) -> tuple[list[User], dict[str, CredentialLife]]:
        return await users(store), await store_identity.user_token_lives(store)

    found, lives = run(with_store, state_dir, work)
    if as_json:
        rows = [
            {
                **attrs.asdict(u),
                "expires_at_ms": lives[u.name].expires_at_ms,
                "revoked_at_ms": lives[u.name].revoked_at_ms,
            }
            for u in found
        ]
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    now = now_ms()
    for u in found:
        life = lives[u.name]
        spent = life.spent(now)
        if spent is not None:
            token = f"{spent[0].upper()} {_utc(spent[1])}"
        elif life.expires_at_ms is None:
            token = "never expires"
        else:
            token = f"expires {_utc(life.expires_at_ms)}"
        click.echo(f"{u.name}  role={u.role}  token {token}")


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")
