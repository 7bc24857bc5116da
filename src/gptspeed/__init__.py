"""gptspeed: pretrain GPT-2 from scratch as fast as the hardware allows, and measure every speed-up."""

__version__ = "0.1.0"
