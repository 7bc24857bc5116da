"""``gptspeed bench``: the optimization ladder, measured on the user's own hardware, peers beside it.

- :mod:`.cli`: the five subcommands (``ladder | verify | profile | race | tune``), each the flags of its
  configuration dataclass; :mod:`.settings`: the flags they share, declared once;
- :mod:`.stages`: the rungs (one :class:`~gptspeed.bench.stages.Stage` entry per technique: a
  name and the run-configuration settings it changes) and the labels / tolerances derived from them;
- :mod:`.worker`: one row measured in a fresh process (:mod:`.entry`), built as ``train`` builds its step;
- :mod:`.ladder`: running all rows, the correctness guard, honest speed-ups, profiling one row;
- :mod:`.report`: Markdown table, JSON, bar chart;
- :mod:`.verify`, :mod:`.verify_worker`, :mod:`.checks`: ``bench verify``, every rung checked
  against fp32 (loss, host-device syncs, graph breaks, recompiles, the SDPA kernel).
"""

_LAZY = {
    "BenchConfig": "ladder",
    "ProfileConfig": "ladder",
    "VerifyConfig": "verify",
    "profile_stage": "ladder",
    "run_ladder": "ladder",
    "BASELINE": "stages",
    "STAGE_NAMES": "stages",
    "STAGES": "stages",
    "Stage": "stages",
    "run_verify": "verify",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):  # PEP 562: importing a submodule does not import its siblings (no import circles)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"gptspeed.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gptspeed.bench' has no attribute {name!r}")
