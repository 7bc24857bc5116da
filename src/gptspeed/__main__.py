"""`python -m gptspeed ...` (also what `torchrun -m gptspeed` runs)."""

from gptspeed.cli import run

run()
