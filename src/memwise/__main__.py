"""``python -m memwise`` runs the ``memwise`` command."""

from memwise.cli import main

raise SystemExit(main())
