"""``python -m gptspeed.bench SPEC.json RESULT.json``: one ladder row in this (fresh) process;
see :func:`gptspeed.bench.worker.main`."""

from gptspeed.bench.worker import main

raise SystemExit(main())
