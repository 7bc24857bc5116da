"""A run out to Hugging Face format: ``gptspeed export-hf --run RUN --out DIR`` (:func:`export_hf`).

It writes ``config.json``, ``model.safetensors``, GPT-2's tokenizer files (``vocab.json``,
``merges.txt``, ``tokenizer.json``, ``tokenizer_config.json``; a run on its own tokenizer: its
``tokenizer.json``, a tiktoken encoding's converted to one, named in config.json's ``gptspeed_tokenizer``,
:func:`gptspeed.run_tokenizer.export_tokenizer`) and a marker (:data:`EXPORT_MARKER`: what it wrote, so
``--force`` replaces an earlier export and nothing else), so
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it
offline with the same logits (the vocabulary padding rows are removed). A GPT-2 run is a
``GPT2LMHeadModel``. A run with architecture switches (``GPTConfig.non_gpt2_switches``: the settings
declared ``export="switch"`` in :mod:`gptspeed.config` -- rotary positions, QK-norm, ReLU², RMSNorm,
an untied head, logit soft-capping, the document mask, value embeddings, U-net skips) or with
``--softmax data`` (its data's token ids in config.json, every other id at probability 0), which no
model of transformers' computes -- Llama's MLP is gated and has no biases, ours is neither -- carries its
own modeling code, :mod:`gptspeed.hf_modeling`'s two files, and both calls take
``trust_remote_code=True`` (https://huggingface.co/docs/transformers/custom_models: a
``PretrainedConfig`` and a ``PreTrainedModel`` subclass named in config.json's ``auto_map``). A
setting declared neither way is refused off its default (:func:`check_exportable`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptspeed.config import GPTConfig
from gptspeed.errors import GptspeedError
from gptspeed.hf.load import CONV1D, _listed, _one_line
from gptspeed.hf.reload import gptspeed_hf_names
from gptspeed.run_tokenizer import export_tokenizer, write_hf_tokenizer

# ------------------------------------------------------------------------------------- export-hf
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``export-hf --dtype``: the dtype the exported tensors are stored in (and config.json's ``dtype``)."""

MODELING_FILES = ("configuration_gptspeed.py", "modeling_gptspeed.py")
"""The files of :mod:`gptspeed.hf_modeling` copied into the export of a run with architecture switches."""


def hf_config_dict(config: GPTConfig, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for ``transformers.GPT2LMHeadModel`` with our shape (vocabulary unpadded).
    Dropout is 0: gptspeed trains without it. ``dtype`` (and ``torch_dtype``, its name before
    transformers 4.56) is the stored tensors' dtype."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.valid_vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": config.eot_token,
        "eos_token_id": config.eot_token,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def gptspeed_config_dict(
    config: GPTConfig, dtype: str = "float32", softmax_ids: list[int] | None = None
) -> dict[str, Any]:
    """``config.json`` of a run with architecture switches, for :mod:`gptspeed.hf_modeling`'s
    ``GptspeedConfig`` (``model_type`` ``gptspeed_gpt``; ``auto_map`` names the two files, so
    ``AutoConfig`` / ``AutoModelForCausalLM`` load them with ``trust_remote_code=True``). The switches
    keep gptspeed's names and values; ``softmax_ids``, a ``--softmax data`` run's token ids (sorted
    ints), masks every other id to probability 0."""
    return {
        "architectures": ["GptspeedForCausalLM"],
        "model_type": "gptspeed_gpt",
        "auto_map": {
            "AutoConfig": "configuration_gptspeed.GptspeedConfig",
            "AutoModelForCausalLM": "modeling_gptspeed.GptspeedForCausalLM",
        },
        "vocab_size": config.valid_vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "pos_emb": config.pos_emb,
        "rope_theta": config.rope_theta,
        "qk_norm": config.qk_norm,
        "mlp": config.mlp,
        "norm": config.norm,
        "tie_embeddings": config.tie_embeddings,
        "logit_softcap": config.logit_softcap,
        "doc_mask": config.doc_mask,
        "value_embeds": config.value_embeds,
        "unet_skips": config.unet_skips,
        "softmax_ids": softmax_ids,
        "softmax_vocab": config.valid_vocab_size,
        "eot_token_id": config.eot_token,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": config.eot_token,
        "eos_token_id": config.eot_token,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def gpt_to_hf_state_dict(
    sd: dict[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """HF ``GPT2LMHeadModel`` tensors (``transformer.``-prefixed, Conv1D weights ``[in, out]``,
    ``dtype``, contiguous) from our state dict; the padding rows of ``wte`` are removed and
    ``lm_head.weight`` is left out (transformers ties it to ``wte`` on load; safetensors cannot store
    shared tensors)."""
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight" or not k.startswith("transformer."):
            continue
        t = t.detach().to("cpu", dtype)
        if k == "transformer.wte.weight":
            t = t[: config.valid_vocab_size]
        elif k.endswith(CONV1D):
            t = t.t()
        out[k] = t.contiguous().clone()
    return out


def gpt_to_gptspeed_hf_state_dict(
    sd: dict[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The tensors of ``modeling_gptspeed.GptspeedForCausalLM``: every tensor of our state dict under
    its own name (``nn.Linear`` weights ``[out, in]``), in ``dtype``, contiguous; the padding rows of
    ``wte``, of the value embeddings and of an untied ``lm_head`` removed, a tied ``lm_head.weight``
    left out (the model reads ``wte``). :func:`gptspeed.hf.reload.gptspeed_hf_names` are the names the model has."""
    out = {}
    for k, t in sd.items():
        if (k == "lm_head.weight" and config.tie_embeddings) or k == "softmax_ids":  # the ids go in config.json
            continue
        t = t.detach().to("cpu", dtype)
        if k in ("transformer.wte.weight", "lm_head.weight") or k.startswith("transformer.ve."):
            t = t[: config.valid_vocab_size]
        out[k] = t.contiguous().clone()
    return out


def check_exportable(config: GPTConfig, where: str) -> None:
    """GptspeedError (one line) naming the settings of ``config`` that no export computes: any
    setting off its default that is not declared exportable (``export=`` in :mod:`gptspeed.config`'s
    field metadata, :func:`gptspeed.config.settings_off_default`): a switch added to the model later
    is never exported as a model that silently computes without it. (``--softmax data`` exports
    through gptspeed's modeling code, its unseen ids masked: :func:`gptspeed_config_dict`.)"""
    from gptspeed.config import EXPORT_KINDS, setting_flag, settings_off_default

    unknown = [f"{setting_flag(n)} {getattr(config, n)}" for n in settings_off_default(config, "export", EXPORT_KINDS)]
    if unknown:
        raise GptspeedError(
            f"{where} uses {', '.join(unknown)}, which export-hf does not write yet (the exported model "
            "would compute without it); sample and eval it with gptspeed"
        )


def _export_contents(config: GPTConfig, sd: dict[str, torch.Tensor], dtype: str) -> tuple[dict, dict, dict, list]:
    """What an export of a model of ``config`` with weights ``sd`` holds, stored in ``dtype``:
    ``(tensors, config.json, generation_config.json, code files to copy)`` -- GPT-2's layout, or with
    architecture switches gptspeed's own (:func:`gptspeed_config_dict`, :data:`MODELING_FILES`)."""
    generation = {"bos_token_id": config.eot_token, "eos_token_id": config.eot_token}
    if not config.non_gpt2_switches() and config.softmax == "full":
        return gpt_to_hf_state_dict(sd, config, EXPORT_DTYPES[dtype]), hf_config_dict(config, dtype), generation, []
    code = [Path(__file__).parent.parent / "hf_modeling" / name for name in MODELING_FILES]
    tensors = gpt_to_gptspeed_hf_state_dict(sd, config, EXPORT_DTYPES[dtype])
    want = gptspeed_hf_names(config)
    if set(tensors) != want:  # a tensor the modeling code would drop, or leave at its initialisation
        odd = sorted(set(tensors) ^ want)
        raise GptspeedError(
            f"the checkpoint's tensors do not match the exported model's ({_listed(odd)} on one side only): "
            "export-hf does not know this architecture"
        )
    ids = sd["softmax_ids"].tolist() if config.softmax == "data" else None
    return tensors, gptspeed_config_dict(config, dtype, ids), generation, code


def write_tokenizer_files(folder: Path, model_max_length: int = 1024) -> None:
    """The run's tokenizer in HF's layout, from the local files (no network): GPT-2's --
    ``vocab.json`` = OpenAI's ``encoder.json``, ``merges.txt`` = ``vocab.bpe``, ``tokenizer.json``
    (the fast tokenizer: byte-level BPE, built from those two files with the ``tokenizers`` library,
    :func:`write_tokenizer_json`), plus the configs. The one place an export's tokenizer is written.

    Raises:
        OSError: as the writes raise it; ImportError without ``tokenizers``
        (:func:`_tokenizers_library` checks it first)."""
    from gptspeed.tokenizer import tokenizer_files

    encoder_json, vocab_bpe = tokenizer_files()
    shutil.copyfile(encoder_json, folder / "vocab.json")
    shutil.copyfile(vocab_bpe, folder / "merges.txt")
    eot = "<|endoftext|>"
    write_tokenizer_json(folder / "tokenizer.json", folder / "vocab.json", folder / "merges.txt", eot)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "model_max_length": model_max_length,
                "add_prefix_space": False,
                "bos_token": eot,
                "eos_token": eot,
                "unk_token": eot,
            },
            indent=2,
        )
        + "\n"
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": eot, "eos_token": eot, "unk_token": eot}, indent=2) + "\n"
    )


def write_tokenizer_json(path: Path, vocab: Path, merges: Path, eot: str) -> None:
    """``tokenizer.json``: a byte-level BPE of ``vocab`` / ``merges`` as GPT-2's fast tokenizer is
    (pre-tokenizer, post-processor and decoder ``ByteLevel``, no prefix space; ``eot`` an added
    special token -- so a literal ``<|endoftext|>`` in text is one token for the export's tokenizer,
    where gptspeed's ordinary encoding reads it as text), built with the ``tokenizers`` library."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tok = Tokenizer(BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    tok.save(str(path))


def _tokenizers_library() -> None:
    """GptspeedError unless the ``tokenizers`` library (transformers' own) can be imported."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise GptspeedError("export-hf writes tokenizer.json with tokenizers: `pip install -e '.[hf]'`") from None


def _apply_umask(folder: Path) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``: 0700) and the files in it the permissions
    every other file gets: 0777 / 0666 less the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


EXPORT_MARKER = ".gptspeed-export.json"
"""Written last into every export-hf folder: the files the export wrote and their sizes. ``--force``
replaces only a folder it describes exactly (or an empty folder): never the user's own files."""


def _evidence(folder: Path, k: str) -> str:
    """What makes ``folder`` a run or data folder (:func:`gptspeed.paths.kind`), for an error line."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return k
    from gptspeed.paths import _CKPT

    if k == "run folder":
        shown = [n for n in names if _CKPT.match(n)] or [n for n in names if n in ("config.json", "metrics.jsonl")]
    else:
        from gptspeed.data import shard_name_split

        shown = [n for n in names if n == "manifest.json" or shard_name_split(n)]
    return f"{k} (it holds {_listed(shown, 2)})"


def _folder_kind(folder: Path) -> str:
    """:func:`gptspeed.paths.kind`, except that a folder is a ``data folder`` only when it is one
    gptspeed reads: a ``manifest.json``, or a shard named as gptspeed's, llm.c's or modded-nanogpt's
    (:func:`gptspeed.data.shard_name_split`) -- not merely any ``*.bin`` file (the user's folder of
    downloads, a ``pytorch_model.bin``)."""
    from gptspeed.data import shard_name_split
    from gptspeed.paths import kind

    k = kind(folder)
    if k == "data folder":
        names = os.listdir(folder)
        if "manifest.json" not in names and not any(shard_name_split(n) for n in names):
            return "folder"
    return k


def _not_an_export(folder: Path) -> str | None:
    """None when ``folder`` holds exactly what an earlier ``export-hf`` wrote there (its
    :data:`EXPORT_MARKER` and the files it lists, at their sizes); else what is there instead."""
    from gptspeed.fileio import read_user_json

    try:
        entries = {e.name: e for e in os.scandir(folder)}
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    if EXPORT_MARKER not in entries:
        return f"it holds {_listed(sorted(entries))}, and no {EXPORT_MARKER} of an earlier export"
    try:
        files = read_user_json(folder / EXPORT_MARKER, "export marker", max_bytes=1 << 16).get("files")
    except GptspeedError as e:
        return str(e)
    if not isinstance(files, dict):
        return f"its {EXPORT_MARKER} lists no files"
    foreign = sorted(n for n in entries if n != EXPORT_MARKER and n not in files)
    if foreign:
        return f"it holds {_listed(foreign)}, which export-hf did not write"
    for name, size in files.items():
        e = entries.get(name)
        if e is None or e.is_symlink() or not e.is_file() or e.stat().st_size != size:
            return f"its {name} is not the one export-hf wrote (changed or removed since)"
    return None


def check_export_target(run: Path, out: Path, force: bool) -> None:
    """Refuse an ``export-hf --out`` that would lose something, before any work: ``out`` equal to
    ``run`` or holding it; ``out`` (or the folder it would be created in) a run folder or a data
    folder (:func:`gptspeed.paths.kind`) -- even with ``force``; a file or a symbolic link; a
    non-empty folder that is not an earlier export (:func:`_not_an_export`) -- even with
    ``force``; an earlier export without ``force``. An empty folder is written into.

    Raises:
        GptspeedError: one line naming what is there.
    """
    if out.is_symlink():
        raise GptspeedError(f"--out {out} is a symbolic link: give the folder to write itself")
    r_run, r_out = run.resolve(), out.resolve()
    if r_out == r_run or r_out in r_run.parents:
        raise GptspeedError(
            f"--out {out} is {'the --run folder' if r_out == r_run else 'a folder holding the --run folder'} "
            f"{run}: an export never replaces the run it exports; choose another --out (e.g. {run}-hf)"
        )
    if not os.path.lexists(out):
        parent = next(p for p in r_out.parents if p.exists())  # the folder the export creates its first entry in
        k = _folder_kind(parent)
        if k in ("run folder", "data folder"):
            raise GptspeedError(
                f"--out {out} would be written into {parent}, a {_evidence(parent, k)}: an export never "
                "writes into one; choose an --out outside it"
            )
        return
    k = _folder_kind(out)
    if k in ("run folder", "data folder"):
        raise GptspeedError(
            f"--out {out} is a {_evidence(out, k)}: export-hf never writes over one, even with --force; "
            "choose another --out"
        )
    if k in ("file", "text file"):
        raise GptspeedError(
            f"--out {out} is a file, not a folder: export-hf never writes over it; choose another --out"
        )
    if k == "empty folder":
        return
    reason = _not_an_export(out)
    if reason is not None:
        raise GptspeedError(
            f"--out {out} is not an earlier export ({reason}): --force replaces only an export-hf "
            "folder or an empty folder; choose another --out"
        )
    if not force:
        raise GptspeedError(
            f"{out} already exists (an earlier export): choose another --out or pass --force to replace it"
        )


def export_hf(run: str | Path, out: str | Path, *, force: bool = False, dtype: str = "float32") -> Path:
    """``gptspeed export-hf``: the newest checkpoint of ``run`` as a Hugging Face folder ``out``
    (``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``, and
    :data:`EXPORT_MARKER`) that ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads
    offline, with the logits of gptspeed's ``GPT`` ``(B, T, 50257)`` (the vocabulary padding removed).
    Written into a temporary folder beside ``out`` and renamed, so ``out`` is never half-written.
    ``force`` replaces an earlier export (the old folder is renamed aside, the new one renamed in,
    then the old one deleted); nothing else is ever replaced, see :func:`check_export_target`.
    Returns ``out``.

    A GPT-2 run (``--zero-init-proj`` only changes the initial weights) is a ``GPT2LMHeadModel``
    (Conv1D weights transposed, LM head tied). A run with architecture switches carries its modeling
    code (:data:`MODELING_FILES`, copied from :mod:`gptspeed.hf_modeling`; config.json's ``auto_map``
    names them), which ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(out,
    trust_remote_code=True)`` load (transformers' "Customizing models",
    https://huggingface.co/docs/transformers/custom_models): rotary positions, QK-norm, ReLU²,
    RMSNorm, an untied head, the logit soft-cap, value embeddings and U-net skips computed as
    gptspeed computes them, under gptspeed's tensor names. The document mask is part of the model,
    as in gptspeed's training, eval and sampling: attention never crosses an ``<|endoftext|>`` of
    the input, with a KV cache too (the first layer's cached keys carry the EOT flags).
    A ``--softmax data`` run (the quickstart's ``--preset nano``) goes the same way, its token ids
    in config.json's ``softmax_ids``: every other id gets logit -inf, as in gptspeed.
    ``--attention`` and ``--residual-dtype`` do not change the function the model computes, so the
    export has neither; a setting it does not compute is refused (:func:`check_exportable`). The
    marker names the run's folder (its last component), never a path of the user's machine.

    ``dtype`` (:data:`EXPORT_DTYPES`): ``float32`` (as trained: the logits equal gptspeed's fp32
    ones to rounding), or ``bfloat16``, half the bytes (GPT-2 XL: 3.1 GB instead of 6.2 GB); the
    tensors are stored in it and config.json's ``dtype`` / ``torch_dtype`` name it.

    Raises:
        GptspeedError: a ``dtype`` not in :data:`EXPORT_DTYPES`; no checkpoint in ``run``; an ``out``
            refused by :func:`check_export_target`; a run :func:`check_exportable` refuses (a setting
            not declared exportable); safetensors or tokenizers not installed; not writable.
    """
    from gptspeed.checkpoint import load_latest_run

    save_file = _safetensors_writer(dtype)
    _tokenizers_library()
    run, out = Path(run), Path(out)
    check_export_target(run, out, force)
    ckpt, run_config = load_latest_run(run)
    config = run_config.model
    check_exportable(config, str(run))
    from gptspeed.averaging import readout_state  # --ema-tail-ratio: the tail average's blend, once it started

    tok = export_tokenizer(run, config)  # None: GPT-2's files, as before
    tensors, config_json, generation, code = _export_contents(config, readout_state(ckpt), dtype)
    if tok is not None:  # what --init-from compares with its data's (gptspeed.run_tokenizer.source_tokenizer)
        config_json["gptspeed_tokenizer"] = config.tokenizer
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise GptspeedError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    try:
        _save_safetensors(save_file, tensors, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for path in code:
            shutil.copyfile(path, tmp / path.name)
        if tok is None:
            write_tokenizer_files(tmp, config.block_size)
        else:
            write_hf_tokenizer(tmp, tok, config.block_size)
        _write_marker(tmp, run, ckpt.get("step"))
        _apply_umask(tmp)
        _move_into_place(tmp, out)
    except OSError as e:
        full = ": free some space, then export again" if e.errno == errno.ENOSPC else ""
        raise GptspeedError(f"could not write {out}: {e.strerror or e}{full} (nothing was written there)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _safetensors_writer(dtype: str):
    """safetensors' ``save_file``, after checking ``dtype`` is one of :data:`EXPORT_DTYPES`.

    Raises:
        GptspeedError: another ``dtype``; safetensors not installed."""
    if dtype not in EXPORT_DTYPES:
        raise GptspeedError(f"export-hf --dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise GptspeedError("export-hf writes safetensors: `pip install safetensors`") from None
    return save_file


def _write_marker(folder: Path, run: Path, step: int | None) -> None:
    """:data:`EXPORT_MARKER` into ``folder``, last: the files there (name -> size in bytes), the
    name of the ``run``'s folder (its last component only: no path of the user's machine travels
    with an export pushed to a hub) and its checkpoint's ``step``. OSError as the write raises it."""
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
    marker = {"exported_by": "gptspeed export-hf", "run": run.resolve().name, "step": step, "files": files}
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished export ``tmp`` to ``out``. An ``out`` already there (an earlier export or
    an empty folder, checked by :func:`check_export_target`) is renamed aside first, and deleted
    once ``tmp`` is in its place (put back if that rename fails). OSError as the renames raise it."""
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.{secrets.token_hex(4)}.old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _save_safetensors(save_file, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file(tensors, path)``, whose write errors (safetensors' Rust writer raises a
    ``SafetensorError`` "I/O error: No space left on device (os error 28)", not an OSError) are
    re-raised as the OSError they are, so the export's one line names them."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as e:  # SafetensorError
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise OSError(f"safetensors could not write {path.name}: {_one_line(e)}") from None
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from None
