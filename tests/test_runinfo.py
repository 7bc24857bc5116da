"""``gptspeed.runinfo``: what a run says about itself: ``config.json`` (the final configuration, what was derived from it, the environment), the banner it prints at start, and the command that resumes it."""

from __future__ import annotations

from pathlib import Path


def test_the_resume_line_names_the_launcher_and_processes(monkeypatch):
    from types import SimpleNamespace

    from gptspeed.trainer import resume_command

    one = SimpleNamespace(distributed=False, world_size=1)
    assert resume_command(one, Path("r")) == "gptspeed train --out r --resume"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(SimpleNamespace(distributed=True, world_size=2), Path("r")) == (
        "torchrun --standalone --nproc_per_node 2 -m gptspeed train --out r --resume"
    )
    assert resume_command(SimpleNamespace(distributed=True, world_size=8), Path("r")).startswith(
        "torchrun --nnodes 4 --nproc_per_node 2 ..."
    )
