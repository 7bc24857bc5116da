"""``python -m gptspeed.bench SPEC.json RESULT.json``: one ladder row or verify rung in this (fresh)
process; see :func:`gptspeed.bench.entry.main`."""

from gptspeed.bench.entry import main

raise SystemExit(main())
