"""``python -m bench.peer``: see bench/peer/run.py."""

from bench.peer.run import main

raise SystemExit(main())
