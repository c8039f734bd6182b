"""Exit codes of the runner's foreground process, the one the agent starts and waits for (the
detached runner's own code is moot).

Rules: constants only, importing nothing: the agent reads them to judge a start without loading
the runner itself (issue 13, goal 4: the idle agent's memory).
"""

from __future__ import annotations

EXIT_STARTED = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_BAD_MEMBER_FILE = 3
EXIT_USAGE = 64
