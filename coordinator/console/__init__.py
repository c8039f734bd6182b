"""The web console: Fleets, Jobs and Job pages and a JSON API, served by the coordinator on its
own listener (``[console]`` in coordinator.toml), in the coordinator's own event loop.

The package reads as a ladder, one direction: sessions (who is signed in, pure) <- errors (typed
errors to HTTP, once) <- reads (the store reads and authorization ``tp``'s calls use) <- views
(values to JSON) <- openapi, pages and job_page (HTML) <- http_parts (requests' parts and
limits) <- api_handlers (the JSON API) <- live (its event streams) <- app (routes, sign-in,
CSRF) <- listener (uvicorn).
"""

from .app import console_app as console_app
from .listener import run_console as run_console
from .reads import ConsoleReads as ConsoleReads
