"""gptspeed: pretrain GPT-2 from scratch as fast as the hardware allows, and measure every speed-up.

The library API (:mod:`gptspeed.api`) is imported on first use, so ``import gptspeed`` stays
light (no torch: ``gptspeed prepare`` relies on it):

- ``gptspeed.make_config(preset, config_file=None, **settings)`` -> :class:`gptspeed.config.RunConfig`
- ``gptspeed.train(config, echo=True)`` -> the training summary (a dict)
- ``gptspeed.load_run(run_dir)`` -> :class:`gptspeed.api.Run` (``.config``, ``.metrics()``, ``.generate()``)
"""

__version__ = "0.1.0"

_LAZY = {
    "make_config": "gptspeed.api",
    "train": "gptspeed.api",
    "load_run": "gptspeed.api",
    "Run": "gptspeed.api",
    "RunConfig": "gptspeed.config",
    "GptspeedError": "gptspeed.errors",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):  # PEP 562: the API's modules are imported when first used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptspeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
