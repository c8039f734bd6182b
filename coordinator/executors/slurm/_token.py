"""The Slurm user a JWT was issued for, read from its ``sun`` claim.

Rules: pure; this reads the claim only, it never verifies the signature (slurmctld does, with its
key). ``scontrol token username=U`` writes the user name into ``sun``; slurmrestd wants the same
name in ``X-SLURM-USER-NAME``, so an operator names only the token file.
"""

from __future__ import annotations

import base64
import binascii
import json

from ._errors import SlurmAuthRefused


def token_user(token: str) -> str:
    """The ``sun`` claim of ``token``; :class:`SlurmAuthRefused` with a sentence when the text is
    not a Slurm JWT."""
    parts = token.strip().split(".")
    fix = "make one with `scontrol token username=USER lifespan=SECONDS` and store its value"
    if len(parts) != 3:
        raise SlurmAuthRefused(f"The Slurm token is not a JWT (three dot-separated parts); {fix}.")
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (binascii.Error, ValueError) as error:
        raise SlurmAuthRefused(
            f"The Slurm token's claims cannot be read ({error}); {fix}."
        ) from None
    user = claims.get("sun") if isinstance(claims, dict) else None
    if not isinstance(user, str) or not user:
        raise SlurmAuthRefused(f"The Slurm token names no user (no 'sun' claim); {fix}.")
    return user


def read_token_file(text: str) -> str:
    """The token in a token file: its value alone, or ``scontrol token``'s ``SLURM_JWT=`` line."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line.removeprefix("SLURM_JWT=")
    raise SlurmAuthRefused(
        "The Slurm token file is empty; write the token from `scontrol token` into it."
    )
