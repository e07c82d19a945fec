"""``python -m dyncp.service``: the plan service, standalone (:mod:`dyncp.service.cli`)."""

from dyncp.service.cli import main

raise SystemExit(main())
