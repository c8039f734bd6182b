"""Driving an existing Slurm cluster through slurmrestd: the one interface a Fleet of kind
``slurm`` will use, one implementation per OpenAPI version, and Slurm's job states read as
TunePlane's.

Rules: callers use :func:`open_slurm_rest` and the :class:`SlurmRest` interface; only
``_v0038`` knows a version's paths and JSON, only ``_http`` knows httpx. Every failure is a
:class:`SlurmError` with a sentence. The package reads as discovery -> v0038 -> http, v0038 ->
states/gres -> values.
"""

from ._discovery import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._discovery import choose_version as choose_version
from ._discovery import offered_versions as offered_versions
from ._discovery import open_slurm_rest as open_slurm_rest
from ._errors import SlurmAuthRefused as SlurmAuthRefused
from ._errors import SlurmError as SlurmError
from ._errors import SlurmJobNotFound as SlurmJobNotFound
from ._errors import SlurmProtocolError as SlurmProtocolError
from ._errors import SlurmRefused as SlurmRefused
from ._errors import SlurmUnreachable as SlurmUnreachable
from ._errors import SlurmVersionUnsupported as SlurmVersionUnsupported
from ._gres import gpu_count as gpu_count
from ._protocol import SlurmRest as SlurmRest
from ._series import parse_series as parse_series
from ._series import series_request as series_request
from ._series import series_words as series_words
from ._settings import SlurmSettingsError as SlurmSettingsError
from ._settings import check_settings as check_settings
from ._settings import probe_settings as probe_settings
from ._settings import read_token as read_token
from ._states import FAILURE_REASONS as FAILURE_REASONS
from ._states import SLURM_TO_JOB_STATE as SLURM_TO_JOB_STATE
from ._states import exit_status as exit_status
from ._states import failure_reason as failure_reason
from ._states import job_state as job_state
from ._states import observed_state as observed_state
from ._token import read_token_file as read_token_file
from ._token import token_user as token_user
from ._values import ExitStatus as ExitStatus
from ._values import JobRequest as JobRequest
from ._values import SlurmJob as SlurmJob
from ._values import SlurmNode as SlurmNode
from ._values import jobs_named as jobs_named
from ._views import partition_view as partition_view
