"""``python -m gptspeed.bench SPEC.json RESULT.json``: one ladder row or verify rung in this (fresh)
process; see :func:`gptspeed.bench.entry.main`."""

from gptspeed.bench.entry import main
from gptspeed.distributed import finish_process

finish_process(main())  # after a one-process FSDP2 row's gloo group, an exit that cannot abort
