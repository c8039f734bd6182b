"""What can go wrong talking to slurmrestd, as types a caller can act on.

Rules: every error carries a sentence naming what was wrong and how to fix it; the HTTP and
transport failures are translated into these once, at the edge (:mod:`._v0038`), so nothing above
sees httpx. Being unable to reach slurmrestd (:class:`SlurmUnreachable`) is never evidence that a
Slurm job failed: the state mapping turns it into ``unknown``.
"""

from __future__ import annotations


class SlurmError(Exception):
    """Any failure to get an answer or an action from slurmrestd."""


class SlurmUnreachable(SlurmError):
    """slurmrestd did not answer (refused connection, timeout, reset): a job's fate is unknown."""


class SlurmAuthRefused(SlurmError):
    """slurmrestd or slurmctld refused the JWT (expired, wrong key, user name not the token's)."""


class SlurmJobNotFound(SlurmError):
    """slurmctld does not know the job id (never submitted, or purged after ``MinJobAge``)."""

    def __init__(self, message: str, job_id: int) -> None:
        super().__init__(message)
        self.job_id = job_id


class SlurmRefused(SlurmError):
    """slurmctld refused a request it understood (a partition that does not exist, a job that
    does not fit); the message carries Slurm's own words."""


class SlurmProtocolError(SlurmError):
    """slurmrestd answered something this client cannot read (an unexpected shape or status)."""


class SlurmVersionUnsupported(SlurmError):
    """slurmrestd serves none of the OpenAPI versions this coordinator speaks."""
