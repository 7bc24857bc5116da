"""The code ``gptspeed export-hf`` ships with a run that is not GPT-2's architecture (rotary
positions, QK-norm, ReLU², RMSNorm, an untied head, logit soft-capping, the document mask, value
embeddings, U-net skips):
``configuration_gptspeed.py`` and ``modeling_gptspeed.py`` are copied, as they are, into the export
folder, and ``transformers`` loads them from there with ``trust_remote_code=True`` (config.json's
``auto_map``). They import nothing of gptspeed's -- the folder works where gptspeed is not installed --
so nothing in gptspeed imports them either: :func:`gptspeed.hf.export.export_hf` copies the files.
"""
