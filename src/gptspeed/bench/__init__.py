"""``gptspeed bench``: the optimization ladder, measured on the user's own hardware, peers beside it.

- :mod:`.stages`: the rungs (one :class:`~gptspeed.bench.stages.Stage` entry per technique);
- :mod:`.worker`: one row measured in a fresh process;
- :mod:`.ladder`: running all rows, the correctness guard, profiling one row;
- :mod:`.report`: Markdown table, JSON, bar chart.
"""

from gptspeed.bench.ladder import BenchConfig, profile_stage, run_ladder
from gptspeed.bench.stages import STAGE_NAMES, STAGES, Settings, Stage

__all__ = ["BenchConfig", "STAGES", "STAGE_NAMES", "Settings", "Stage", "profile_stage", "run_ladder"]
