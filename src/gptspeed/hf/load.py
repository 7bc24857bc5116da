"""GPT-2 weights in from Hugging Face format.

A folder as ``transformers``' ``GPT2LMHeadModel.save_pretrained`` writes it (``config.json`` with
``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``), or one
of OpenAI's released models by name (:data:`NAMED_MODELS`, fetched with
``huggingface_hub.snapshot_download``). ``gptspeed import-hf DIR --out RUN`` writes a run folder
with a step-0 checkpoint (:func:`import_hf`); ``--init-from`` on train / sample / eval loads the
weights directly (:func:`shape_for_init_from`, :func:`load_hf_weights`, :func:`load_hf_model`).
Which settings of a run can start from GPT-2's weights is declared on each setting (``init_from=``
in :mod:`gptspeed.config`'s field metadata); any other setting off its default is refused.

The mapping, as in nanoGPT's ``GPT.from_pretrained``: parameter names are the same (with or
without the ``transformer.`` prefix: OpenAI's own files have none); HF's GPT-2 uses ``Conv1D``,
whose weight is ``[in, out]`` where ``nn.Linear`` has ``[out, in]``, so ``c_attn``, ``c_proj`` and
``c_fc`` weights are transposed; the token embedding (50,257 rows) is padded with zero rows to
our ``vocab_size`` (those logits are -inf, see :class:`gptspeed.model.GPT`); ``attn.bias`` /
``attn.masked_bias`` (causal-mask buffers in old checkpoints) are dropped; the LM head is tied to
the token embedding, unless config.json says ``tie_word_embeddings: false`` (a GPT-2 trained with a
head of its own: the run gets ``--no-tie-embeddings`` and that head). A folder gptspeed's own
``export-hf`` wrote with its modeling code (``model_type`` ``gptspeed_gpt``) comes back with its
switches (:mod:`gptspeed.hf.reload`), and an export of a run on its own tokenizer with it (config.json's
``gptspeed_tokenizer``: its vocabulary, ``<|endoftext|>`` and ``tokenizer.json``, which ``import-hf``
keeps in the run folder). Loading never unpickles code: safetensors, or
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from gptspeed.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, GPTConfig, settings_off_default
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.model import GPT

NAMED_MODELS = {
    "gpt2": "openai-community/gpt2",  # 124M
    "gpt2-medium": "openai-community/gpt2-medium",  # 350M
    "gpt2-large": "openai-community/gpt2-large",  # 774M
    "gpt2-xl": "openai-community/gpt2-xl",  # 1558M
}
"""``--init-from`` names -> Hugging Face Hub repositories of OpenAI's GPT-2 releases."""

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK_PARAMS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)
_DROPPED = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of old transformers versions
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# GPT2Config defaults, for config.json files that leave fields out (OpenAI's gpt2 has no n_layer).
_HF_DEFAULTS = {
    "vocab_size": GPT2_VOCAB_SIZE,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


# ----------------------------------------------------------------------------------------- sources
def resolve_source(source: str) -> Path:
    """The local folder of a Hugging Face GPT-2: ``source`` itself if it is a folder, else one of
    :data:`NAMED_MODELS` downloaded (or found in the Hub cache) with
    ``huggingface_hub.snapshot_download`` — the only step here that uses the network.

    Raises:
        GptspeedError: not a folder and not a known name; huggingface_hub missing; download failed
            (offline, no cached copy).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source not in NAMED_MODELS:
        if path.exists():
            raise GptspeedError(f"{source} is a file, not a folder: give the folder holding config.json")
        raise GptspeedError(f"{source} is neither a folder nor a known model name ({', '.join(NAMED_MODELS)})")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GptspeedError(
            f"--init-from {source} downloads from the Hugging Face Hub, which needs "
            "huggingface_hub: `pip install huggingface_hub` (or give a local folder)"
        ) from None
    repo = NAMED_MODELS[source]
    try:
        return Path(snapshot_download(repo_id=repo, allow_patterns=["config.json", "model.safetensors"]))
    except Exception as e:  # offline: LocalEntryNotFoundError, connection errors, HTTP errors ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GptspeedError(
            f"could not download {repo} from the Hugging Face Hub ({reason}): go online once "
            f"(it is cached after), or download it elsewhere and pass its folder"
        ) from None


def _one_line(e: BaseException) -> str:
    """The first line of an exception's message (or its type), for an error line of our own."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _config_path(folder: Path) -> Path:
    """``folder/config.json``, or GptspeedError when ``folder`` is not a folder or has none."""
    if not folder.is_dir():
        raise GptspeedError(f"model folder {folder} does not exist")
    path = folder / "config.json"
    if not os.path.lexists(path):
        raise GptspeedError(f"{folder} has no config.json: give a folder saved by transformers' save_pretrained")
    return path


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` with GPT2Config's defaults filled in, checked to describe a model this
    package computes exactly: ``model_type`` gpt2, GELU (tanh), 4x MLP, LayerNorm eps 1e-5,
    attention scaled by 1/sqrt(head size), a GPT-2-tokenizer vocabulary (>= 50,257 rows) -- or,
    exported by gptspeed from a run on its own tokenizer, that tokenizer's
    (:func:`gptspeed.hf.reload.export_vocab`, the ``tokenizer.json`` it ships checked).

    The file is read with :func:`gptspeed.fileio.read_user_json` (a folder, a FIFO, non-UTF-8
    bytes, a JSON list, NaN constants: one line each), and every field used is type-checked
    (JSON ``true`` is no integer, ``"1e-5"`` no number) before any arithmetic on it.

    Raises:
        GptspeedError: folder or config.json missing or unreadable, a field of the wrong type, or a
            setting we do not implement.
    """
    from gptspeed.fileio import read_user_json

    path = _config_path(Path(folder))
    cfg = {**_HF_DEFAULTS, **read_user_json(path, "Hugging Face config", max_bytes=1 << 20)}
    model_type = cfg.get("model_type")
    if model_type != "gpt2":
        shown = repr(model_type) if isinstance(model_type, (str, type(None))) else f"JSON {type(model_type).__name__}"
        raise GptspeedError(f"{path} describes a {shown} model: only GPT-2 (model_type 'gpt2') is supported")
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if type(cfg[name]) is not int or cfg[name] < 1:
            raise GptspeedError(f"{path}: {name} = {_shown(cfg[name])} is not a positive integer")
    if not _is_number(cfg["layer_norm_epsilon"]):
        raise GptspeedError(f"{path}: layer_norm_epsilon = {_shown(cfg['layer_norm_epsilon'])} is not a number")
    if not isinstance(cfg["tie_word_embeddings"], bool):
        raise GptspeedError(f"{path}: tie_word_embeddings = {_shown(cfg['tie_word_embeddings'])} is not true or false")
    checks = [
        (cfg["activation_function"] in ("gelu_new", "gelu_pytorch_tanh"), "activation_function", "gelu_new"),
        (
            cfg["n_inner"] is None or (type(cfg["n_inner"]) is int and cfg["n_inner"] == 4 * cfg["n_embd"]),
            "n_inner",
            "null (4 * n_embd)",
        ),
        (abs(cfg["layer_norm_epsilon"] - 1e-5) < 1e-12, "layer_norm_epsilon", "1e-05"),
        (cfg["scale_attn_weights"] is True, "scale_attn_weights", "true"),
        (cfg["scale_attn_by_inverse_layer_idx"] is False, "scale_attn_by_inverse_layer_idx", "false"),
        (cfg["add_cross_attention"] is False, "add_cross_attention", "false"),
    ]
    for ok, name, want in checks:
        if not ok:
            raise GptspeedError(f"{path}: {name} = {_shown(cfg[name])} is not supported (gptspeed's GPT needs {want})")
    from gptspeed.hf.reload import check_export_tokenizer, export_vocab

    identity, n_vocab, eot = export_vocab(cfg, str(path))  # gptspeed's export of a run on its own tokenizer
    if identity != "gpt2":
        check_export_tokenizer(Path(folder), identity, n_vocab, eot)
    elif cfg["vocab_size"] < GPT2_VOCAB_SIZE:
        raise GptspeedError(
            f"{path}: vocab_size {cfg['vocab_size']} is smaller than GPT-2's {GPT2_VOCAB_SIZE}: "
            "gptspeed uses the GPT-2 tokenizer"
        )
    if cfg["n_embd"] % cfg["n_head"]:
        raise GptspeedError(f"{path}: n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}")
    return cfg


def _shown(value: Any) -> str:
    """A config value for an error line: its repr, cut short (a field may hold a long list)."""
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def gpt_config_from_hf(
    hf: dict[str, Any], *, block_size: int | None = None, vocab_size: int | None = None
) -> GPTConfig:
    """Our :class:`GPTConfig` for an HF GPT-2 config (as from :func:`read_hf_config`).

    ``block_size`` defaults to ``n_positions`` (a smaller one keeps the first rows of ``wpe``);
    ``vocab_size`` defaults to 50,304 (HF's 50,257 padded to a multiple of 64), or HF's own
    vocab_size rounded up to a multiple of 64 when that is larger (for gptspeed's export of a run on
    its own tokenizer, that rounding is the default, and the tokenizer's identity, ids and
    ``<|endoftext|>`` are config.json's). ``tie_word_embeddings`` false
    (a GPT-2 trained with its own head) is an untied head, ``--no-tie-embeddings``.
    """
    n_positions = hf["n_positions"]
    block_size = block_size or n_positions
    if block_size > n_positions:
        raise GptspeedError(f"sequence length {block_size} is longer than the model's {n_positions} positions")
    from gptspeed.hf.reload import export_vocab

    identity, n_vocab, eot = export_vocab(hf, "config.json")
    padded = -(-hf["vocab_size"] // 64) * 64
    vocab_size = max(vocab_size or (PADDED_VOCAB_SIZE if identity == "gpt2" else padded), padded)
    return GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        valid_vocab_size=n_vocab,
        eot_token=eot,
        tokenizer=identity,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        tie_embeddings=hf["tie_word_embeddings"],
    )


def shape_for_init_from(source: str, model: GPTConfig, explicit: dict[str, Any]) -> GPTConfig:
    """The model shape of a run that starts from the HF GPT-2 ``source`` (``train --init-from``):
    n_layer / n_head / n_embd from its config.json; ``block_size`` as given on the command line
    (``explicit``, at most ``n_positions``) else ``n_positions``; ``vocab_size``, ``attention`` and
    ``loss`` from ``model`` (vocabulary grown to fit if needed).

    The source's tensor names and shapes are checked against the shape here (:func:`check_hf_layout`,
    from the file headers), so a config.json that does not describe its weights is refused before
    the run builds a model of the size it claims.

    The settings declared ``init_from="kept"`` in :mod:`gptspeed.config` (those that need no
    weights of their own: ``doc_mask``, ``logit_softcap``, ``attn_window``, ``residual_dtype`` ...)
    are kept from ``model`` too; any other setting off its default (rotary positions, RMSNorm,
    ReLU², QK-norm, an untied head, zero-init projections, value embeddings, U-net skips, and any
    setting not declared), from a flag, ``--recipe`` or a config file, is refused before the source
    is read (:func:`check_init_from_switches`).

    A gptspeed export (config.json's ``model_type`` ``gptspeed_gpt``) brings its own switches back
    (:func:`gptspeed.hf.reload.shape_from_export`); an untied GPT-2 (``tie_word_embeddings`` false)
    makes the run's head untied (``--no-tie-embeddings``).

    Raises:
        GptspeedError: as :func:`resolve_source` / :func:`read_hf_config` / :func:`check_hf_layout`,
            an explicit --n-layer / --n-head / --n-embd that contradicts the source, or an
            architecture switch GPT-2's weights cannot take.
    """
    from gptspeed.hf import reload

    local = Path(source).expanduser()
    if local.is_dir() and reload.model_type(local) == reload.MODEL_TYPE:
        return reload.shape_from_export(local, source, model, explicit, _read_stored(local))
    check_init_from_switches(source, model)
    folder = resolve_source(source)
    hf = read_hf_config(folder)
    for name in ("n_layer", "n_head", "n_embd"):
        if name in explicit and explicit[name] != hf[name]:
            raise GptspeedError(
                f"--{name.replace('_', '-')} {explicit[name]} contradicts --init-from {source}, "
                f"whose {name} is {hf[name]}: leave it out"
            )
    shape = gpt_config_from_hf(hf, block_size=explicit.get("block_size"), vocab_size=model.vocab_size)
    check_hf_layout(read_hf_shapes(folder), shape, where=str(folder), vocab_rows=hf["vocab_size"])
    kept = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.metadata.get("init_from") == "kept"}
    return dataclasses.replace(shape, **kept)


def check_init_from_switches(source: str, model: GPTConfig) -> None:
    """GptspeedError (one line naming them) when ``model`` sets a setting away from its default that
    is not declared to start from GPT-2's weights (``init_from=`` in :mod:`gptspeed.config`'s field
    metadata, :func:`gptspeed.config.settings_off_default`): ``--init-from`` would silently drop it.
    A setting added without a declaration is refused here until it is declared."""
    from gptspeed.config import INIT_FROM_KINDS, setting_flag

    named = []
    for name in settings_off_default(model, "init_from", INIT_FROM_KINDS):
        value, flag = getattr(model, name), setting_flag(name)
        named.append((flag if value else "--no-" + flag[2:]) if isinstance(value, bool) else f"{flag} {value}")
    if named:
        raise GptspeedError(
            f"--init-from {source} starts from GPT-2's weights, which {', '.join(named)} would not fit "
            "(from a flag, --recipe or the config file): leave them out, or train from scratch "
            "without --init-from"
        )


# ----------------------------------------------------------------------------------------- weights
def _check_weights_file(path: Path) -> None:
    """GptspeedError unless ``path`` is a regular file: a folder, a FIFO (whose read would block
    forever) or a device under a weights file's name is one line, never a traceback or a hang."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise GptspeedError(f"weights file {path} does not exist") from None
    except OSError as e:
        raise GptspeedError(f"cannot read weights file {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise GptspeedError(f"weights file {path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise GptspeedError(f"weights file {path} is not a regular file (a pipe, socket or device): give a file")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise GptspeedError("reading model.safetensors needs safetensors: `pip install safetensors`") from None
    _check_weights_file(path)
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorError (truncated, bad header), OSError
        raise GptspeedError(f"{path} is not a readable safetensors file ({_one_line(e)})") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    _check_weights_file(path)
    try:  # weights_only: tensors and containers only, no pickled code runs
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise GptspeedError(
            f"{path} is not a readable weights-only PyTorch file ({type(e).__name__}): convert it to safetensors"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise GptspeedError(f"{path} does not hold a flat state dict of tensors")
    return sd


def _weight_files(folder: Path) -> tuple[str, list[Path]]:
    """``("safetensors" | "bin", files)``: the weights files of an HF folder, the first of
    :data:`_WEIGHT_FILES` present (a sharded checkpoint's shards as its ``*.index.json`` names them,
    read with :func:`gptspeed.fileio.read_user_json`; shard names must be plain file names in
    ``folder``)."""
    from gptspeed.fileio import read_user_json

    name = next((n for n in _WEIGHT_FILES if os.path.lexists(folder / n)), None)
    if name is None:
        raise GptspeedError(f"{folder} has no weights ({' or '.join(_WEIGHT_FILES)})")
    fmt = "safetensors" if name.startswith("model.safetensors") else "bin"
    if not name.endswith(".index.json"):
        return fmt, [folder / name]
    index = folder / name
    weight_map = read_user_json(index, "weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise GptspeedError(f"weights index {index} has no weight_map (tensor name -> shard file)")
    shards = set(map(json.dumps, weight_map.values()))  # any JSON value, hashable
    bad = next(
        (
            f
            for f in map(json.loads, sorted(shards))
            if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")
        ),
        None,
    )
    if bad is not None:
        raise GptspeedError(
            f"weights index {index} names the shard {_shown(bad)}: shards must be files of the model folder itself"
        )
    return fmt, [folder / json.loads(f) for f in sorted(shards)]


def _merged(folder: Path, parts: list[dict]) -> dict:
    """One dict of the shards' entries, names without the ``transformer.`` prefix."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            key = k.removeprefix("transformer.")
            if key in out:
                raise GptspeedError(f"{folder} holds the tensor {key} twice: not a GPT-2 saved by transformers")
            out[key] = v
    return out


def read_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model folder, names without the ``transformer.`` prefix, as stored
    (HF layout: Conv1D weights ``[in, out]``). Prefers safetensors over ``pytorch_model.bin``;
    sharded checkpoints are read through their ``*.index.json``.

    Raises:
        GptspeedError: no weights file; one that is a folder, a pipe, truncated or otherwise
            unreadable; an index without a proper ``weight_map``; a tensor named twice.
    """
    folder = Path(folder)
    fmt, files = _weight_files(folder)
    loader = _load_safetensors if fmt == "safetensors" else _load_bin
    return _merged(folder, [loader(f) for f in files])


def _read_stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder`` under its stored name (a gptspeed export's own names, the
    ``transformer.`` prefix kept). GptspeedError as :func:`read_hf_state_dict`."""
    fmt, files = _weight_files(folder)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update((_load_safetensors if fmt == "safetensors" else _load_bin)(f))
    return out


def read_hf_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensor names (without ``transformer.``) and shapes of an HF model folder, without
    reading the tensors where the format allows it (a safetensors header; a ``.bin`` is
    memory-mapped): what :func:`check_hf_layout` needs before a model is built.

    Raises:
        GptspeedError: as :func:`read_hf_state_dict`.
    """
    folder = Path(folder)
    fmt, files = _weight_files(folder)
    parts = []
    for f in files:
        _check_weights_file(f)
        if fmt == "bin":
            parts.append({k: tuple(v.shape) for k, v in _load_bin(f).items()})
            continue
        try:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                parts.append({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except ImportError:
            raise GptspeedError("reading model.safetensors needs safetensors: `pip install safetensors`") from None
        except Exception as e:  # SafetensorError (truncated, bad header), OSError
            raise GptspeedError(f"{f} is not a readable safetensors file ({_one_line(e)})") from None
    return _merged(folder, parts)


def _listed(names: list[str], n: int = 3, total: int | None = None) -> str:
    """``a, b, c and 9 more``: the first ``n`` of ``total`` (default ``len(names)``) names."""
    total = len(names) if total is None else total
    return ", ".join(names[:n]) + (f" and {total - min(n, len(names))} more" if total > min(n, len(names)) else "")


_LAYER = re.compile(r"^h\.(0|[1-9][0-9]*)\.(.+)$")


def check_hf_layout(
    shapes: dict[str, tuple[int, ...]], config: GPTConfig, *, where: str = "the model", vocab_rows: int | None = None
) -> None:
    """Whether the HF tensors ``shapes`` (name without prefix -> shape) are exactly a GPT-2 of
    ``config``'s shape: every tensor one the model uses (besides ``lm_head.weight`` and the
    causal-mask buffers ``h.i.attn.bias`` / ``h.i.attn.masked_bias`` of its own layers), every
    parameter there at its shape (Conv1D ``[in, out]``), ``wte`` with ``vocab_rows`` rows (the
    config.json's vocab_size) when given. The cost follows the tensors present, not the layers the
    config claims: a config.json saying 10^9 layers over 2-layer weights is refused at once.

    Raises:
        GptspeedError: naming how many tensors are unexpected, missing or of the wrong shape,
            and the first few.
    """
    C, L = config.n_embd, config.n_layer
    top = {"wte.weight": None, "wpe.weight": None, "ln_f.weight": (C,), "ln_f.bias": (C,)}
    block = {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        "attn.c_attn.weight": (C, 3 * C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "mlp.c_fc.weight": (C, 4 * C),
        "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (4 * C, C),
        "mlp.c_proj.bias": (C,),
    }
    assert set(block) == set(_BLOCK_PARAMS)
    shape = f"a GPT-2 with n_layer {L}, n_embd {C}"
    wanted: dict[str, tuple | None] = {}
    unexpected = []
    for k in shapes:
        m = _LAYER.match(k)
        own_layer = m is not None and int(m[1]) < L
        if k in top:
            wanted[k] = top[k]
        elif own_layer and m[2] in block:
            wanted[k] = block[m[2]]
        elif not (k == "lm_head.weight" or (own_layer and m[2] in _DROPPED)):
            unexpected.append(k)
    if unexpected:
        raise GptspeedError(
            f"{where} holds {len(unexpected)} tensor(s) that {shape} does not have "
            f"({_listed(unexpected)}): its config.json does not describe its weights"
        )
    n_missing = len(top) + len(block) * L - len(wanted)
    if n_missing:
        missing = [k for k in top if k not in shapes]
        for i in range(L):  # stops at the first few missing: bounded by the layers present
            if len(missing) >= 3:
                break
            missing += [f"h.{i}.{p}" for p in _BLOCK_PARAMS if f"h.{i}.{p}" not in shapes]
        raise GptspeedError(
            f"{where} lacks {n_missing} tensor(s) of {shape} ({_listed(missing, total=n_missing)}): "
            "its config.json does not describe its weights, or the weights are incomplete"
        )
    wrong = [f"{k} {shapes[k]} not {want}" for k, want in wanted.items() if want is not None and shapes[k] != want]
    wte, wpe = shapes["wte.weight"], shapes["wpe.weight"]
    rows = f"{vocab_rows}" if vocab_rows is not None else f"<= {config.vocab_size}"
    if len(wte) != 2 or wte[1] != C or wte[0] > config.vocab_size or (vocab_rows is not None and wte[0] != vocab_rows):
        wrong.append(f"wte.weight {wte} not ({rows}, {C})")
    if len(wpe) != 2 or wpe[1] != C or wpe[0] < config.block_size:
        wrong.append(f"wpe.weight {wpe} not (>= {config.block_size}, {C})")
    if wrong:
        raise GptspeedError(
            f"{where}: {len(wrong)} tensor(s) of the wrong shape for {shape} ({_listed(wrong)}; "
            "Conv1D weights are [in, out]): its config.json does not describe its weights"
        )


def hf_to_gpt_state_dict(
    hf_sd: dict[str, torch.Tensor],
    config: GPTConfig,
    *,
    where: str = "the model",
    tied: bool = True,
    vocab_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Our state dict (fp32, ``transformer.``-prefixed, ``lm_head.weight`` = ``wte``) from HF tensors
    (names without prefix). ``wte`` is padded with zero rows to ``config.vocab_size``, ``wpe`` cut
    to ``config.block_size`` rows, Conv1D weights transposed.

    The names and shapes are checked by :func:`check_hf_layout` (every tensor used, every
    parameter filled), and every value must be finite: a config.json that does not describe its
    weights, or diverged weights, are refused, never half-loaded.

    Raises:
        GptspeedError: as :func:`check_hf_layout`; the first tensor holding NaN or inf (or not
            floating point); an untied LM head that differs from the token embedding (our GPT ties them).
    """
    check_hf_layout({k: tuple(v.shape) for k, v in hf_sd.items()}, config, where=where, vocab_rows=vocab_rows)
    C, L = config.n_embd, config.n_layer
    used = [
        "wte.weight",
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
        *(f"h.{i}.{p}" for i in range(L) for p in _BLOCK_PARAMS),
    ]
    if not config.tie_embeddings and "lm_head.weight" not in hf_sd:
        raise GptspeedError(f"{where}: its config.json says the LM head is untied, but it holds no lm_head.weight")
    for k in [*used, *(["lm_head.weight"] if "lm_head.weight" in hf_sd and not tied else [])]:
        t = hf_sd[k]
        if not (t.is_floating_point() and bool(torch.isfinite(t).all())):
            what = "holds NaN or infinite values" if t.is_floating_point() else f"is not floating point ({t.dtype})"
            raise GptspeedError(f"{where}: tensor {k} {what}: the weights are corrupt or diverged; use another copy")
    wte, wpe = hf_sd["wte.weight"].float(), hf_sd["wpe.weight"].float()
    head = hf_sd.get("lm_head.weight")
    untied = not config.tie_embeddings
    if (
        head is not None
        and not tied
        and not untied
        and not (head.shape == wte.shape and torch.equal(head.float(), wte))
    ):
        raise GptspeedError(
            f"{where} has an LM head that is not tied to the token embedding, but its config.json ties them "
            "(tie_word_embeddings): an untied GPT-2 says false there"
        )
    if untied and tuple(head.shape) != tuple(wte.shape):
        raise GptspeedError(
            f"{where}: lm_head.weight {tuple(head.shape)} is not the token embedding's shape {tuple(wte.shape)}"
        )
    out = {"transformer.wpe.weight": wpe[: config.block_size].clone()}
    padded = torch.zeros(config.vocab_size, C)
    padded[: wte.shape[0]] = wte
    out["transformer.wte.weight"] = padded
    out["lm_head.weight"] = padded
    if untied:
        out["lm_head.weight"] = torch.zeros(config.vocab_size, C)
        out["lm_head.weight"][: head.shape[0]] = head.float()
    for k in ("ln_f.weight", "ln_f.bias"):
        out[f"transformer.{k}"] = hf_sd[k].float()
    for i in range(L):
        for p in _BLOCK_PARAMS:
            t = hf_sd[f"h.{i}.{p}"].float()
            out[f"transformer.h.{i}.{p}"] = t.t().contiguous() if p in CONV1D else t
    return out


_MODEL_BUFFERS = ("softmax_ids",)  # the model's own buffers: not weights, kept as the model has them


def _fill(model: GPT, sd: dict[str, torch.Tensor], where: str) -> None:
    """Load ``sd`` into ``model``: every parameter of the model filled, every tensor of ``sd``
    used (the model's own buffers, :data:`_MODEL_BUFFERS`, keep their values)."""
    own = set(model.state_dict())
    missing = sorted(own - set(sd) - set(_MODEL_BUFFERS))
    unexpected = sorted(set(sd) - own)
    if missing or unexpected:  # a mapping bug rather than a user's file: hf_to_gpt_state_dict checked the names
        raise GptspeedError(
            f"{where} does not fill gptspeed's GPT (missing {_listed(missing) or 'none'}; "
            f"unexpected {_listed(unexpected) or 'none'})"
        )
    with torch.no_grad():
        model.load_state_dict(sd, strict=False)


def _read_checked(folder: Path, hf: dict[str, Any], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The weights of ``folder`` as our state dict for ``config``, every name, shape and value
    checked (:func:`hf_to_gpt_state_dict`) -- before a model of the config's size is built, so a
    config.json claiming a huge model over small weights is refused, not allocated."""
    return hf_to_gpt_state_dict(
        read_hf_state_dict(folder),
        config,
        where=str(folder),
        tied=hf["tie_word_embeddings"],
        vocab_rows=hf["vocab_size"],
    )


def load_hf_weights(model: GPT, source: str) -> Path:
    """Copy the weights of the HF GPT-2 ``source`` (folder or :data:`NAMED_MODELS` name) into
    ``model``, whose shape must match (``block_size`` may be shorter than ``n_positions``).
    Returns the folder the weights came from.

    Raises:
        GptspeedError: as :func:`resolve_source`, :func:`read_hf_config`, :func:`hf_to_gpt_state_dict`,
            or the model's n_layer / n_head / n_embd differ from the source's.
    """
    from gptspeed.hf import reload

    folder = resolve_source(source)
    if reload.model_type(folder) == reload.MODEL_TYPE:  # the shape and switches came from it too
        _fill(model, reload.state_dict_from_export(_read_stored(folder), model.config, str(folder)), str(folder))
        reload.set_ids(model, reload.gpt_config_from_export(folder)[1], str(folder))
        return folder
    hf = read_hf_config(folder)
    c = model.config
    for name in ("n_layer", "n_head", "n_embd"):
        if getattr(c, name) != hf[name]:
            raise GptspeedError(f"--init-from {source} has {name} {hf[name]}, the run's model {getattr(c, name)}")
    _fill(model, _read_checked(folder, hf, c), str(folder))
    return folder


def load_hf_model(source: str, *, block_size: int | None = None) -> tuple[GPT, dict[str, Any]]:
    """A :class:`GPT` (fp32, CPU, eval mode) holding the HF GPT-2 ``source`` (folder or name).
    Returns ``(model, info)`` with ``info = {"source", "folder", "hf_config"}``. The weights are
    read and checked before the model is built. A gptspeed export comes back with its switches
    (:func:`gptspeed.hf.reload.load_export`)."""
    from gptspeed.hf import reload

    folder = resolve_source(source)
    if reload.model_type(folder) == reload.MODEL_TYPE:
        from gptspeed.fileio import read_user_json

        hf = read_user_json(folder / "config.json", "Hugging Face config", max_bytes=1 << 24)
        config, ids = reload.gpt_config_from_export(folder, block_size)
        sd = reload.state_dict_from_export(_read_stored(folder), config, str(folder))  # before building the model
        model = GPT(config)
        _fill(model, sd, str(folder))
        reload.set_ids(model, ids, str(folder))
        return model.eval(), {"source": source, "folder": str(folder), "hf_config": hf}
    hf = read_hf_config(folder)
    config = gpt_config_from_hf(hf, block_size=block_size)
    sd = _read_checked(folder, hf, config)
    model = GPT(config)
    _fill(model, sd, str(folder))
    return model.eval(), {"source": source, "folder": str(folder), "hf_config": hf}


# ------------------------------------------------------------------------------------- import-hf
def run_config_for(model_config: GPTConfig, **train_fields):
    """A :class:`RunConfig` for an imported model: the preset of the same shape (gpt2 ...) if one
    matches, else the ``gpt2`` preset's training settings, with ``model_config`` as the model."""
    from gptspeed.config import PRESETS, preset

    name = next(
        (
            n
            for n, p in PRESETS.items()
            if (p.model.n_layer, p.model.n_head, p.model.n_embd)
            == (model_config.n_layer, model_config.n_head, model_config.n_embd)
        ),
        None,
    )
    cfg = preset(name or "gpt2")
    cfg.model = model_config
    cfg.preset = name or "custom"
    return cfg.override(train_fields)


def import_hf(source: str, out: str | Path) -> Path:
    """``gptspeed import-hf``: write the run folder ``out`` holding a step-0 checkpoint of the HF
    GPT-2 ``source`` (folder or name), and its ``config.json``. ``sample``/``eval --run out`` use it;
    ``train --out out --resume --data D`` trains it (fresh optimizer; the model shape is fixed).
    gptspeed's export of a run on its own tokenizer brings it along (its ``tokenizer.json`` copied
    into ``out``, :func:`_keep_tokenizer`). Returns the checkpoint path.

    Raises:
        GptspeedError: as :func:`load_hf_model`; ``out`` already holds checkpoints, holds files
            gptspeed did not write (:func:`gptspeed.checkpoint.refuse_foreign_folder`: e.g. the
            source folder itself) or is not writable.
    """
    from gptspeed.checkpoint import refuse_checkpoints, refuse_foreign_folder
    from gptspeed.paths import real_path

    out = real_path(out)  # nothere/../victim is victim: checked as the folder it names
    refuse_checkpoints(out, "choose another --out")
    refuse_foreign_folder(out)  # the source folder itself, a data folder, the user's files: never written into
    model, info = load_hf_model(source)
    with _held(out):  # as train holds it: never written into while a live train writes there
        refuse_checkpoints(out, "choose another --out")
        return _write_import(model, info, source, out)


@contextlib.contextmanager
def _held(out: Path):
    """``out`` made, and held by its run folder lock (:func:`gptspeed.checkpoint.folder.run_lock`)
    as train holds it, for the ``with`` block.

    Raises:
        GptspeedError: ``out`` cannot be made; another process (a live train) holds it."""
    from gptspeed.checkpoint.folder import run_lock

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptspeedError(f"cannot create run folder {out}: {e.strerror or e}") from None
    lock = run_lock(out).acquire()
    try:
        yield
    finally:
        lock.release()


def _write_import(model: GPT, info: dict, source: str, out: Path) -> Path:
    """The step-0 checkpoint and config.json of an imported ``model`` into ``out`` (held)."""
    from gptspeed.checkpoint import save_checkpoint

    cfg = run_config_for(model.config, out=str(out), init_from=str(source))
    source_info = {"hf_source": str(source), "hf_folder": info["folder"]}
    path = save_checkpoint(
        out, {"step": 0, "model": model.state_dict(), "config": cfg.to_dict(), "source": source_info}, keep=1
    )
    write_text_atomic(out / "config.json", json.dumps({**cfg.to_dict(), "source": source_info}, indent=2) + "\n")
    _keep_tokenizer(model.config, Path(info["folder"]), out)
    return path


def _keep_tokenizer(config: GPTConfig, folder: Path, out: Path) -> None:
    """The export's ``tokenizer.json`` (``folder``'s, sha256-checked against ``config.tokenizer``) copied
    into the run folder ``out`` as the trainer keeps its data's
    (:data:`gptspeed.run_tokenizer.RUN_TOKENIZER_FILE`), when the model's tokenizer is one: the
    imported run samples and evaluates with it. GPT-2's and a tiktoken encoding need no file."""
    from gptspeed.run_tokenizer import RUN_TOKENIZER_FILE, SHA_PREFIX, tokenizer_of

    if config.tokenizer.startswith(SHA_PREFIX):
        write_text_atomic(out / RUN_TOKENIZER_FILE, tokenizer_of(config.tokenizer, folder).json_text)
