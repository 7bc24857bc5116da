"""GPT-2 weights in and out of Hugging Face format: :mod:`gptspeed.hf.load` reads a Hugging Face
GPT-2 (``import-hf``, ``--init-from`` on train / sample / eval), :mod:`gptspeed.hf.export` writes a
run as a Hugging Face folder (``export-hf``). :mod:`gptspeed.hf_modeling` is the modeling code an
export of a run with architecture switches ships.

Which settings a start from GPT-2's weights takes and which an export carries is declared on each
setting in :mod:`gptspeed.config` (``init_from=`` and ``export=`` in its field's metadata): a setting
declared neither way is refused off its default, by both.
"""
