"""gptspeed's own exports back in: a folder ``gptspeed export-hf`` wrote for a run with
architecture switches or ``--softmax data`` (config.json's ``model_type`` ``gptspeed_gpt``, read by
:mod:`gptspeed.hf_modeling` in transformers) as a :class:`~gptspeed.model.GPT` with the same
switches -- for ``import-hf``, ``--init-from`` on train / sample / eval (:mod:`gptspeed.hf.load`
dispatches here, reads the tensors and fills the model; this module imports nothing of
:mod:`gptspeed.hf` so there is no import circle).

The mapping is the export's, reversed (:func:`gptspeed.hf.export.gpt_to_gptspeed_hf_state_dict`):
every tensor under gptspeed's own name; the token embedding, the value embeddings and an untied
head padded with zero rows to the run's ``vocab_size`` (those logits are -inf); a tied head read
from the token embedding; ``softmax_ids`` from config.json into the model's buffer. The switches
come back from config.json: the run computes what the export computed.

An export of a run on its own tokenizer (config.json's ``gptspeed_tokenizer``, the run's
``GPTConfig.tokenizer``) comes back with it: the vocabulary (``vocab_size`` ids, padded to a multiple
of 64) and ``<|endoftext|>`` (``eos_token_id``) from config.json, checked against the tokenizer the
export ships (:func:`export_vocab`, :func:`check_export_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from gptspeed.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, GPTConfig
from gptspeed.errors import GptspeedError

MODEL_TYPE = "gptspeed_gpt"
"""config.json's ``model_type`` of an export with gptspeed's modeling code."""

_SHAPE = ("n_layer", "n_head", "n_embd")
_SWITCHES = (
    "pos_emb",
    "rope_theta",
    "qk_norm",
    "mlp",
    "norm",
    "tie_embeddings",
    "logit_softcap",
    "doc_mask",
    "value_embeds",
    "unet_skips",
)
"""The GPTConfig fields an export's config.json carries under their own names (besides the shape)."""


def model_type(folder: Path) -> Any:
    """config.json's ``model_type`` in ``folder`` (None when there is none or it is unreadable: the
    GPT-2 reader then says why)."""
    from gptspeed.fileio import read_user_json

    try:
        return read_user_json(folder / "config.json", "Hugging Face config", max_bytes=1 << 24).get("model_type")
    except GptspeedError:
        return None


def export_vocab(hf: dict[str, Any], where: str) -> tuple[str, int, int]:
    """``(tokenizer identity, token ids, <|endoftext|> id)`` of the export whose config.json is ``hf``:
    GPT-2's (``gpt2``, 50,257, 50,256) without ``gptspeed_tokenizer`` (or with ``gpt2``), else
    ``gptspeed_tokenizer`` (``sha256:HEX`` of its ``tokenizer.json``, or a tiktoken encoding's name),
    ``vocab_size`` and ``eos_token_id``.

    Raises:
        GptspeedError: one of those fields of the wrong type or out of range."""
    from gptspeed.run_tokenizer import GPT2, SHA_PREFIX

    identity = hf.get("gptspeed_tokenizer", GPT2)
    if identity == GPT2:
        return GPT2, GPT2_VOCAB_SIZE, GPT2_VOCAB_SIZE - 1
    n, eot = hf.get("vocab_size"), hf.get("eos_token_id")
    sha = isinstance(identity, str) and identity.startswith(SHA_PREFIX)
    ok = isinstance(identity, str) and (not sha or re.fullmatch(r"[0-9a-f]{64}", identity[len(SHA_PREFIX) :]))
    if not (ok and type(n) is int and n >= 1 and type(eot) is int and 0 <= eot < n):
        raise GptspeedError(
            f"{where}: gptspeed_tokenizer, vocab_size and eos_token_id are not a tokenizer's identity, its ids "
            "and its <|endoftext|> id: not a config.json gptspeed export-hf wrote"
        )
    return identity, n, eot


def check_export_tokenizer(folder: Path, identity: str, n_vocab: int, eot: int) -> None:
    """GptspeedError unless the export in ``folder`` ships the tokenizer its config.json names
    (:func:`export_vocab`): its ``tokenizer.json`` of that sha256 (a tiktoken encoding: the encoding
    itself), with ``n_vocab`` ids and ``<|endoftext|>`` ``eot``. GPT-2's is not checked (as before)."""
    from gptspeed.run_tokenizer import GPT2, tokenizer_of

    if identity == GPT2:
        return
    tok = tokenizer_of(identity, folder)
    if (tok.n_vocab, tok.eot) != (n_vocab, eot):
        raise GptspeedError(
            f"{folder}: its tokenizer has {tok.n_vocab:,} ids and <|endoftext|> {tok.eot}, its config.json "
            f"{n_vocab:,} and {eot}: not a folder gptspeed export-hf wrote"
        )


def gpt_config_from_export(folder: Path, block_size: int | None = None) -> tuple[GPTConfig, list[int] | None]:
    """The :class:`GPTConfig` of the gptspeed export in ``folder`` (its switches, ``softmax data``
    when it has ``softmax_ids``; ``block_size`` default ``n_positions``, at most that) and its
    ``softmax_ids`` (sorted ints, or None).

    Raises:
        GptspeedError: a field missing or of the wrong type, a vocabulary other than its tokenizer's
            (e.g. resized by ``resize_token_embeddings``), the tokenizer missing or changed
            (:func:`check_export_tokenizer`), or a shape gptspeed refuses."""
    from gptspeed.fileio import read_user_json
    from gptspeed.run_tokenizer import GPT2, padded_vocab

    path = folder / "config.json"
    hf = read_user_json(path, "Hugging Face config", max_bytes=1 << 24)
    fields = {"block_size": hf.get("n_positions"), **{k: hf.get(k) for k in (*_SHAPE, *_SWITCHES)}}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise GptspeedError(f"{path} lacks {', '.join(missing)}: not a config.json gptspeed export-hf wrote")
    identity, n_vocab, eot = export_vocab(hf, str(path))
    if hf.get("vocab_size") != n_vocab:
        raise GptspeedError(
            f"{path}: vocab_size {hf.get('vocab_size')!r} is not GPT-2's tokenizer's {GPT2_VOCAB_SIZE} "
            "(resized after the export?): gptspeed uses the GPT-2 tokenizer"
        )
    check_export_tokenizer(folder, identity, n_vocab, eot)
    ids = hf.get("softmax_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise GptspeedError(f"{path}: softmax_ids is not a list of token ids")
    if block_size is not None:
        if block_size > fields["block_size"]:
            raise GptspeedError(
                f"sequence length {block_size} is longer than the model's {fields['block_size']} positions"
            )
        fields["block_size"] = block_size
    try:
        config = GPTConfig(
            **fields,
            vocab_size=PADDED_VOCAB_SIZE if identity == GPT2 else padded_vocab(n_vocab),
            valid_vocab_size=n_vocab,
            eot_token=eot,
            tokenizer=identity,
            softmax="data" if ids is not None else "full",
        )
        config.validate()
    except (TypeError, ValueError) as e:
        raise GptspeedError(f"{path} does not describe a gptspeed model ({e})") from None
    except GptspeedError as e:
        raise GptspeedError(f"{path} does not describe a gptspeed model: {e}") from None
    return config, ids


def _names(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def state_dict_from_export(tensors: dict[str, torch.Tensor], config: GPTConfig, where: str) -> dict[str, torch.Tensor]:
    """Our state dict (fp32) for ``config`` from the export's ``tensors`` (as stored, gptspeed's
    names): every name the export has (:func:`gptspeed_hf_names`) at its shape, every value finite;
    the vocabulary rows padded with zeros to ``config.vocab_size``, ``wpe`` cut to ``block_size``
    rows, a tied ``lm_head.weight`` the token embedding.

    Raises:
        GptspeedError: a tensor missing, unexpected, of the wrong shape, or holding NaN / inf."""
    from gptspeed.model import GPT

    want = gptspeed_hf_names(config)
    if set(tensors) != want:
        odd = sorted(set(tensors) ^ want)
        raise GptspeedError(
            f"{where}: its tensors do not match its config.json ({_names(odd)} on one side only): "
            "not a folder gptspeed export-hf wrote"
        )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    out = {}
    for k, t in tensors.items():
        if not (t.is_floating_point() and bool(torch.isfinite(t).all())):
            raise GptspeedError(f"{where}: tensor {k} holds NaN or infinite values (or is not floating point)")
        t = t.float()
        if k == "transformer.wpe.weight":
            t = t[: config.block_size]
        rows = k in ("transformer.wte.weight", "lm_head.weight") or k.startswith("transformer.ve.")
        if rows and t.dim() == 2 and t.size(0) <= config.vocab_size:
            t = torch.cat((t, t.new_zeros(config.vocab_size - t.size(0), t.size(1))))
        if tuple(t.shape) != shapes[k]:
            raise GptspeedError(
                f"{where}: tensor {k} is {tuple(tensors[k].shape)}, not of the model its config.json describes"
            )
        out[k] = t.contiguous()
    if config.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def set_ids(model, ids: list[int] | None, where: str) -> None:
    """The export's ``softmax_ids`` into ``model`` (a ``--softmax data`` :class:`GPT`); GptspeedError
    when they are not sorted, unique ids of the vocabulary."""
    if ids is not None:
        try:
            model.set_softmax_ids(ids)
        except ValueError as e:
            raise GptspeedError(f"{where}: softmax_ids: {e}") from None


def shape_from_export(
    folder: Path, source: str, model: GPTConfig, explicit: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> GPTConfig:
    """``model`` (the run's settings) with the architecture of the export in ``folder``: its shape
    and switches (and ``--softmax data`` when it has softmax ids); ``block_size`` as given
    (``explicit``), else the export's; its ``tensors`` (as stored) checked to fit. A setting given explicitly that contradicts the export is
    refused: the run would not be the model it starts from.

    Raises:
        GptspeedError: as :func:`gpt_config_from_export`; an explicit contradiction."""
    from gptspeed.config import setting_flag

    config, ids = gpt_config_from_export(folder, explicit.get("block_size"))
    carried = (*_SHAPE, *_SWITCHES, "softmax")
    for name in carried:
        if name in explicit and explicit[name] != getattr(config, name):
            raise GptspeedError(
                f"{setting_flag(name)} {explicit[name]} contradicts --init-from {source}, whose {name} is "
                f"{getattr(config, name)}: leave it out (the switches come from the export)"
            )
    state_dict_from_export(tensors, config, str(folder))  # the weights fit, before the run builds its model
    carried += ("valid_vocab_size", "eot_token", "tokenizer")  # the data's already (run_tokenizer.fit_model_to_data)
    return dataclasses.replace(model, block_size=config.block_size, **{n: getattr(config, n) for n in carried})


def gptspeed_hf_names(config: GPTConfig) -> set[str]:
    """The tensor names of ``modeling_gptspeed.GptspeedForCausalLM`` for ``config`` (those
    ``export-hf`` writes and this module reads back)."""
    norm = ("weight", "bias") if config.norm == "layernorm" else ("weight",)
    block = [f"{n}.{p}" for n in ("ln_1", "ln_2") for p in norm]
    block += [f"{m}.{p}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj") for p in ("weight", "bias")]
    names = {"transformer.wte.weight", *(f"transformer.ln_f.{p}" for p in norm)}
    names |= {f"transformer.h.{i}.{b}" for i in range(config.n_layer) for b in block}
    if config.pos_emb == "learned":
        names.add("transformer.wpe.weight")
    if not config.tie_embeddings:
        names.add("lm_head.weight")
    n, k = config.n_layer, config.value_embeds
    names |= {f"transformer.ve.{j}.weight" for j in range(k)}
    names |= {f"transformer.h.{i}.attn.ve_gates" for i in range(n) if k and (i < k or i >= n - k)}
    if config.unet_skips:
        names.add("skip_weights")
    return names
