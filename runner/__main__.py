"""Entry point: ``python -m tuneplane.runner <member_dir>`` (see :mod:`tuneplane.runner.main`)."""

from .main import main

raise SystemExit(main())
