"""``gptspeed bench``: the optimization ladder, measured on the user's own hardware, peers beside it.

- :mod:`.stages`: the rungs (one :class:`~gptspeed.bench.stages.Stage` entry per technique) and
  the switches / tolerances that describe them;
- :mod:`.worker`: one row measured in a fresh process, and the one adapter into the trainer;
- :mod:`.ladder`: running all rows, the correctness guard, honest speed-ups, profiling one row;
- :mod:`.report`: Markdown table, JSON, bar chart;
- :mod:`.verify`, :mod:`.verify_worker`, :mod:`.checks`: ``bench --verify``, every rung checked
  against fp32 (loss, host-device syncs, graph breaks, recompiles, the SDPA kernel).
"""

from gptspeed.bench.ladder import BenchConfig, profile_stage, run_ladder
from gptspeed.bench.stages import STAGE_NAMES, STAGES, Settings, Stage
from gptspeed.bench.verify import run_verify

__all__ = ["BenchConfig", "STAGES", "STAGE_NAMES", "Settings", "Stage", "profile_stage", "run_ladder", "run_verify"]
