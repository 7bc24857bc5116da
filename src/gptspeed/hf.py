"""GPT-2 weights in and out of Hugging Face format.

In: a folder as ``transformers``' ``GPT2LMHeadModel.save_pretrained`` writes it (``config.json``
with ``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``),
or one of OpenAI's released models by name (:data:`NAMED_MODELS`, fetched with
``huggingface_hub.snapshot_download``). ``gptspeed import-hf DIR --out RUN`` writes a run folder
with a step-0 checkpoint; ``--init-from`` on train / sample / eval loads the weights directly.

Out: ``gptspeed export-hf --run RUN --out DIR`` writes ``config.json``, ``model.safetensors``,
GPT-2's tokenizer files (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``) and a marker
(:data:`EXPORT_MARKER`: what it wrote, so ``--force`` replaces an earlier export and nothing else), so
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it
offline with the same logits (the vocabulary padding rows are removed). A GPT-2 run is a
``GPT2LMHeadModel``. A run with architecture switches (``GPTConfig.non_gpt2_switches``: rotary
positions, QK-norm, ReLU², RMSNorm, an untied head, logit soft-capping, the document mask, value
embeddings, U-net skips), which no model of transformers' computes -- Llama's MLP is gated and has
no biases, ours is neither -- carries its own modeling code, :mod:`gptspeed.hf_modeling`'s two
files, and both calls take ``trust_remote_code=True`` (https://huggingface.co/docs/transformers/custom_models: a
``PretrainedConfig`` and a ``PreTrainedModel`` subclass named in config.json's ``auto_map``).

The mapping, as in nanoGPT's ``GPT.from_pretrained``: parameter names are the same (with or
without the ``transformer.`` prefix: OpenAI's own files have none); HF's GPT-2 uses ``Conv1D``,
whose weight is ``[in, out]`` where ``nn.Linear`` has ``[out, in]``, so ``c_attn``, ``c_proj`` and
``c_fc`` weights are transposed; the token embedding (50,257 rows) is padded with zero rows to
our ``vocab_size`` (those logits are -inf, see :class:`gptspeed.model.GPT`); ``attn.bias`` /
``attn.masked_bias`` (causal-mask buffers in old checkpoints) are dropped; the LM head is tied to
the token embedding. Loading never unpickles code: safetensors, or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
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

from gptspeed.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, GPTConfig
from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.model import GPT
from gptspeed.tokenizer import EOT_TOKEN

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
    attention scaled by 1/sqrt(head size), a GPT-2-tokenizer vocabulary (>= 50,257 rows).

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
    if cfg["vocab_size"] < GPT2_VOCAB_SIZE:
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
    vocab_size rounded up to a multiple of 64 when that is larger.
    """
    n_positions = hf["n_positions"]
    block_size = block_size or n_positions
    if block_size > n_positions:
        raise GptspeedError(f"sequence length {block_size} is longer than the model's {n_positions} positions")
    padded = -(-hf["vocab_size"] // 64) * 64
    vocab_size = max(vocab_size or PADDED_VOCAB_SIZE, padded)
    return GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        valid_vocab_size=GPT2_VOCAB_SIZE,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
    )


def shape_for_init_from(source: str, model: GPTConfig, explicit: dict[str, Any]) -> GPTConfig:
    """The model shape of a run that starts from the HF GPT-2 ``source`` (``train --init-from``):
    n_layer / n_head / n_embd from its config.json; ``block_size`` as given on the command line
    (``explicit``, at most ``n_positions``) else ``n_positions``; ``vocab_size``, ``attention`` and
    ``loss`` from ``model`` (vocabulary grown to fit if needed).

    The source's tensor names and shapes are checked against the shape here (:func:`check_hf_layout`,
    from the file headers), so a config.json that does not describe its weights is refused before
    the run builds a model of the size it claims.

    The switches that need no weights of their own -- ``doc_mask``, ``logit_softcap``,
    ``residual_dtype`` -- are kept from ``model`` too; those GPT-2's weights cannot take
    (:data:`INIT_FROM_REFUSED`: rotary positions, RMSNorm, ReLU², QK-norm, an untied head, zero-init
    projections), from a flag, ``--recipe`` or a config file, are refused before the source is read.

    Raises:
        GptspeedError: as :func:`resolve_source` / :func:`read_hf_config` / :func:`check_hf_layout`,
            an explicit --n-layer / --n-head / --n-embd that contradicts the source, or an
            architecture switch GPT-2's weights cannot take.
    """
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
    return dataclasses.replace(
        shape,
        attention=model.attention,
        loss=model.loss,
        softmax=model.softmax,
        doc_mask=model.doc_mask,
        logit_softcap=model.logit_softcap,
        residual_dtype=model.residual_dtype,
    )


# The model settings GPT-2's weights cannot take: another layout or function of its tensors (rotary
# positions have no wpe, RMSNorm no bias, QK-norm and an untied head tensors of their own), or an
# initialisation the loaded weights replace (zero-init projections).
INIT_FROM_REFUSED = ("pos_emb", "norm", "mlp", "qk_norm", "tie_embeddings", "zero_init_proj")


def check_init_from_switches(source: str, model: GPTConfig) -> None:
    """GptspeedError (one line naming them) when ``model`` sets any of :data:`INIT_FROM_REFUSED`
    away from GPT-2's: ``--init-from`` would silently drop them."""
    from gptspeed.config import setting_flag

    gpt2 = GPTConfig()
    named = []
    for name in INIT_FROM_REFUSED:
        value = getattr(model, name)
        if value != getattr(gpt2, name):
            flag = setting_flag(name)
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
    for k in [*used, *(["lm_head.weight"] if "lm_head.weight" in hf_sd and not tied else [])]:
        t = hf_sd[k]
        if not (t.is_floating_point() and bool(torch.isfinite(t).all())):
            what = "holds NaN or infinite values" if t.is_floating_point() else f"is not floating point ({t.dtype})"
            raise GptspeedError(f"{where}: tensor {k} {what}: the weights are corrupt or diverged; use another copy")
    wte, wpe = hf_sd["wte.weight"].float(), hf_sd["wpe.weight"].float()
    head = hf_sd.get("lm_head.weight")
    if head is not None and not tied and not (head.shape == wte.shape and torch.equal(head.float(), wte)):
        raise GptspeedError(f"{where} has an LM head that is not tied to the token embedding: gptspeed's GPT ties them")
    out = {"transformer.wpe.weight": wpe[: config.block_size].clone()}
    padded = torch.zeros(config.vocab_size, C)
    padded[: wte.shape[0]] = wte
    out["transformer.wte.weight"] = padded
    out["lm_head.weight"] = padded
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
    folder = resolve_source(source)
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
    read and checked before the model is built."""
    folder = resolve_source(source)
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
    Returns the checkpoint path.

    Raises:
        GptspeedError: as :func:`load_hf_model`; ``out`` already holds checkpoints, holds files
            gptspeed did not write (:func:`gptspeed.checkpoint.refuse_foreign_folder`: e.g. the
            source folder itself) or is not writable.
    """
    from gptspeed.checkpoint import refuse_checkpoints, refuse_foreign_folder, save_checkpoint

    out = Path(out)
    refuse_checkpoints(out, "choose another --out")
    refuse_foreign_folder(out)  # the source folder itself, a data folder, the user's files: never written into
    model, info = load_hf_model(source)
    cfg = run_config_for(model.config, out=str(out), init_from=str(source))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptspeedError(f"cannot create run folder {out}: {e.strerror or e}") from None
    source_info = {"hf_source": str(source), "hf_folder": info["folder"]}
    path = save_checkpoint(
        out, {"step": 0, "model": model.state_dict(), "config": cfg.to_dict(), "source": source_info}, keep=1
    )
    write_text_atomic(out / "config.json", json.dumps({**cfg.to_dict(), "source": source_info}, indent=2) + "\n")
    return path


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
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def gptspeed_config_dict(config: GPTConfig, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of a run with architecture switches, for :mod:`gptspeed.hf_modeling`'s
    ``GptspeedConfig`` (``model_type`` ``gptspeed_gpt``; ``auto_map`` names the two files, so
    ``AutoConfig`` / ``AutoModelForCausalLM`` load them with ``trust_remote_code=True``). The switches
    keep gptspeed's names and values."""
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
        "eot_token_id": EOT_TOKEN,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
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
    left out (the model reads ``wte``). :func:`gptspeed_hf_names` are the names the model has."""
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight" and config.tie_embeddings:
            continue
        t = t.detach().to("cpu", dtype)
        if k in ("transformer.wte.weight", "lm_head.weight") or k.startswith("transformer.ve."):
            t = t[: config.valid_vocab_size]
        out[k] = t.contiguous().clone()
    return out


EXPORTED_FIELDS = frozenset(
    {
        # the shape
        "block_size",
        "vocab_size",
        "valid_vocab_size",
        "n_layer",
        "n_head",
        "n_embd",
        # how the model computes, trains or starts, not what it computes
        "attention",
        "loss",
        "residual_dtype",
        "zero_init_proj",
        "softmax",  # "data" is refused on its own
        # the switches modeling_gptspeed.py computes
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
    }
)
"""The :class:`GPTConfig` fields an export carries (or that do not change the function the model
computes). A run with any other field off its default is refused: a switch added to the model
later is never exported as a model that silently computes without it."""


def check_exportable(config: GPTConfig, where: str) -> None:
    """GptspeedError (one line) naming the settings of ``config`` that no export computes:
    ``--softmax data``, and any field outside :data:`EXPORTED_FIELDS` that is not at its default."""
    from gptspeed.config import setting_flag

    if config.softmax == "data":
        raise GptspeedError(
            f"{where} was trained with --softmax data (its LM head covers only the tokens of its training "
            "data); transformers' models have no such restriction, so it cannot be exported faithfully"
        )
    default = GPTConfig()
    unknown = [
        f"{setting_flag(f.name)} {getattr(config, f.name)}"
        for f in dataclasses.fields(GPTConfig)
        if f.name not in EXPORTED_FIELDS and getattr(config, f.name) != getattr(default, f.name)
    ]
    if unknown:
        raise GptspeedError(
            f"{where} uses {', '.join(unknown)}, which export-hf does not write yet (the exported model "
            "would compute without it); sample and eval it with gptspeed"
        )


def gptspeed_hf_names(config: GPTConfig) -> set[str]:
    """The tensor names of ``modeling_gptspeed.GptspeedForCausalLM`` for ``config``."""
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


def _export_contents(config: GPTConfig, sd: dict[str, torch.Tensor], dtype: str) -> tuple[dict, dict, dict, list]:
    """What an export of a model of ``config`` with weights ``sd`` holds, stored in ``dtype``:
    ``(tensors, config.json, generation_config.json, code files to copy)`` -- GPT-2's layout, or with
    architecture switches gptspeed's own (:func:`gptspeed_config_dict`, :data:`MODELING_FILES`)."""
    generation = {"bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN}
    if not config.non_gpt2_switches():
        return gpt_to_hf_state_dict(sd, config, EXPORT_DTYPES[dtype]), hf_config_dict(config, dtype), generation, []
    code = [Path(__file__).parent / "hf_modeling" / name for name in MODELING_FILES]
    tensors = gpt_to_gptspeed_hf_state_dict(sd, config, EXPORT_DTYPES[dtype])
    want = gptspeed_hf_names(config)
    if set(tensors) != want:  # a tensor the modeling code would drop, or leave at its initialisation
        odd = sorted(set(tensors) ^ want)
        raise GptspeedError(
            f"the checkpoint's tensors do not match the exported model's ({_listed(odd)} on one side only): "
            "export-hf does not know this architecture"
        )
    return tensors, gptspeed_config_dict(config, dtype), generation, code


def write_tokenizer_files(folder: Path, model_max_length: int = 1024) -> None:
    """GPT-2's tokenizer in HF's layout, from the local OpenAI files (no network):
    ``vocab.json`` = ``encoder.json``, ``merges.txt`` = ``vocab.bpe``, plus the configs."""
    from gptspeed.tokenizer import tokenizer_files

    encoder_json, vocab_bpe = tokenizer_files()
    shutil.copyfile(encoder_json, folder / "vocab.json")
    shutil.copyfile(vocab_bpe, folder / "merges.txt")
    eot = "<|endoftext|>"
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
        shown = [n for n in names if n == "manifest.json" or n.endswith(".bin")]
    return f"{k} (it holds {_listed(shown, 2)})"


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
    from gptspeed.paths import kind

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
        k = kind(parent)
        if k in ("run folder", "data folder"):
            raise GptspeedError(
                f"--out {out} would be written into {parent}, a {_evidence(parent, k)}: an export never "
                "writes into one; choose an --out outside it"
            )
        return
    k = kind(out)
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
    ``--attention`` and ``--residual-dtype`` do not change the function the model computes, so the
    export has neither; a setting it does not compute is refused (:func:`check_exportable`).

    ``dtype`` (:data:`EXPORT_DTYPES`): ``float32`` (as trained: the logits equal gptspeed's fp32
    ones to rounding), or ``bfloat16``, half the bytes (GPT-2 XL: 3.1 GB instead of 6.2 GB); the
    tensors are stored in it and config.json's ``dtype`` / ``torch_dtype`` name it.

    Raises:
        GptspeedError: a ``dtype`` not in :data:`EXPORT_DTYPES`; no checkpoint in ``run``; an ``out``
            refused by :func:`check_export_target`; a run :func:`check_exportable` refuses (--softmax
            data, a setting outside :data:`EXPORTED_FIELDS`); not writable.
    """
    from gptspeed.checkpoint import load_latest_run

    if dtype not in EXPORT_DTYPES:
        raise GptspeedError(f"export-hf --dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise GptspeedError("export-hf writes safetensors: `pip install safetensors`") from None
    run, out = Path(run), Path(out)
    check_export_target(run, out, force)
    ckpt, run_config = load_latest_run(run)
    config = run_config.model
    check_exportable(config, str(run))
    tensors, config_json, generation, code = _export_contents(config, ckpt["model"], dtype)
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
        write_tokenizer_files(tmp, config.block_size)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        (tmp / EXPORT_MARKER).write_text(
            json.dumps(
                {"exported_by": "gptspeed export-hf", "run": str(run), "step": ckpt.get("step"), "files": files},
                indent=2,
            )
            + "\n"
        )
        _apply_umask(tmp)
        if os.path.lexists(out):  # an earlier export or an empty folder (checked): move it aside, swap, delete it
            old = out.with_name(f".{out.name}.{secrets.token_hex(4)}.old")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        full = ": free some space, then export again" if e.errno == errno.ENOSPC else ""
        raise GptspeedError(f"could not write {out}: {e.strerror or e}{full} (nothing was written there)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
