"""gptspeed: pretrain GPT-2 from scratch as fast as the hardware allows, and measure every speed-up.

The library API (:mod:`gptspeed.api`) is imported on first use, so ``import gptspeed`` stays
light (no torch: ``gptspeed prepare`` relies on it):

- ``gptspeed.make_config(preset, config_file=None, **settings)`` -> :class:`gptspeed.config.RunConfig`
- ``gptspeed.train(config, echo=True)`` -> the training summary (a dict)
- ``gptspeed.load_run(run_dir)`` -> :class:`gptspeed.api.Run` (``.config``, ``.metrics()``, ``.generate()``)
"""

__version__ = "0.1.0"

#: native Windows lacks the POSIX modules gptspeed's run folders and measurements use (fcntl's file
#: locks, resource's memory peaks); WSL2 is a Linux and runs it, GPU included
WINDOWS_LINE = (
    "gptspeed does not run on native Windows (it needs POSIX file locks); run it in WSL2, where it "
    "works with the GPU too: https://learn.microsoft.com/windows/wsl/install"
)

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
        import sys

        if sys.platform == "win32":
            raise ImportError(WINDOWS_LINE)

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptspeed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
