"""GPT-2 weights in and out of Hugging Face format.

In: a folder as ``transformers``' ``GPT2LMHeadModel.save_pretrained`` writes it (``config.json``
with ``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``),
or one of OpenAI's released models by name (:data:`NAMED_MODELS`, fetched with
``huggingface_hub.snapshot_download``). ``gptspeed import-hf DIR --out RUN`` writes a run folder
with a step-0 checkpoint; ``--init-from`` on train / sample / eval loads the weights directly.

Out: ``gptspeed export-hf --run RUN --out DIR`` writes ``config.json``, ``model.safetensors`` and
GPT-2's tokenizer files (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``), so
``GPT2LMHeadModel.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it
offline with the same logits (the vocabulary padding rows are removed).

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
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptspeed.errors import GptspeedError
from gptspeed.fileio import write_text_atomic
from gptspeed.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, GPTConfig
from gptspeed.model import GPT

NAMED_MODELS = {
    "gpt2": "openai-community/gpt2",  # 124M
    "gpt2-medium": "openai-community/gpt2-medium",  # 350M
    "gpt2-large": "openai-community/gpt2-large",  # 774M
    "gpt2-xl": "openai-community/gpt2-xl",  # 1558M
}
"""``--init-from`` names -> Hugging Face Hub repositories of OpenAI's GPT-2 releases."""

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias")
_DROPPED = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of old transformers versions
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# GPT2Config defaults, for config.json files that leave fields out (OpenAI's gpt2 has no n_layer).
_HF_DEFAULTS = {"vocab_size": GPT2_VOCAB_SIZE, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "add_cross_attention": False, "tie_word_embeddings": True}


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
        raise GptspeedError(f"{source} is neither a folder nor a known model name "
                            f"({', '.join(NAMED_MODELS)})")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GptspeedError(f"--init-from {source} downloads from the Hugging Face Hub, which needs "
                            "huggingface_hub: `pip install huggingface_hub` (or give a local folder)") from None
    repo = NAMED_MODELS[source]
    try:
        return Path(snapshot_download(repo_id=repo, allow_patterns=["config.json", "model.safetensors"]))
    except Exception as e:  # offline: LocalEntryNotFoundError, connection errors, HTTP errors ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GptspeedError(f"could not download {repo} from the Hugging Face Hub ({reason}): go online once "
                            f"(it is cached after), or download it elsewhere and pass its folder") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GptspeedError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise GptspeedError(f"{path} is not a JSON object")
    return data


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` with GPT2Config's defaults filled in, checked to describe a model this
    package computes exactly: ``model_type`` gpt2, GELU (tanh), 4x MLP, LayerNorm eps 1e-5,
    attention scaled by 1/sqrt(head size), a GPT-2-tokenizer vocabulary (>= 50,257 rows).

    Raises:
        GptspeedError: folder or config.json missing, not JSON, or a setting we do not implement.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise GptspeedError(f"model folder {folder} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise GptspeedError(f"{folder} has no config.json: give a folder saved by transformers' save_pretrained")
    cfg = {**_HF_DEFAULTS, **_read_json(path)}
    model_type = cfg.get("model_type")
    if model_type != "gpt2":
        raise GptspeedError(f"{path} describes a {model_type!r} model: only GPT-2 (model_type 'gpt2') is supported")
    checks = [
        (cfg["activation_function"] in ("gelu_new", "gelu_pytorch_tanh"), "activation_function", "gelu_new"),
        (cfg["n_inner"] in (None, 4 * cfg["n_embd"]), "n_inner", "null (4 * n_embd)"),
        (abs(float(cfg["layer_norm_epsilon"]) - 1e-5) < 1e-12, "layer_norm_epsilon", "1e-05"),
        (cfg["scale_attn_weights"] is True, "scale_attn_weights", "true"),
        (cfg["scale_attn_by_inverse_layer_idx"] is False, "scale_attn_by_inverse_layer_idx", "false"),
        (cfg["add_cross_attention"] is False, "add_cross_attention", "false"),
    ]
    for ok, name, want in checks:
        if not ok:
            raise GptspeedError(f"{path}: {name} = {cfg[name]!r} is not supported (gptspeed's GPT needs {want})")
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(cfg[name], int) or cfg[name] < 1:
            raise GptspeedError(f"{path}: {name} = {cfg[name]!r} is not a positive integer")
    if cfg["vocab_size"] < GPT2_VOCAB_SIZE:
        raise GptspeedError(f"{path}: vocab_size {cfg['vocab_size']} is smaller than GPT-2's {GPT2_VOCAB_SIZE}: "
                            "gptspeed uses the GPT-2 tokenizer")
    if cfg["n_embd"] % cfg["n_head"]:
        raise GptspeedError(f"{path}: n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}")
    return cfg


def gpt_config_from_hf(hf: dict[str, Any], *, block_size: int | None = None,
                       vocab_size: int | None = None) -> GPTConfig:
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
    return GPTConfig(block_size=block_size, vocab_size=vocab_size, valid_vocab_size=GPT2_VOCAB_SIZE,
                     n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"])


def shape_for_init_from(source: str, model: GPTConfig, explicit: dict[str, Any]) -> GPTConfig:
    """The model shape of a run that starts from the HF GPT-2 ``source`` (``train --init-from``):
    n_layer / n_head / n_embd from its config.json; ``block_size`` as given on the command line
    (``explicit``, at most ``n_positions``) else ``n_positions``; ``vocab_size``, ``attention`` and
    ``loss`` from ``model`` (vocabulary grown to fit if needed).

    Raises:
        GptspeedError: as :func:`resolve_source` / :func:`read_hf_config`, or an explicit
            --n-layer / --n-head / --n-embd that contradicts the source.
    """
    hf = read_hf_config(resolve_source(source))
    for name in ("n_layer", "n_head", "n_embd"):
        if name in explicit and explicit[name] != hf[name]:
            raise GptspeedError(f"--{name.replace('_', '-')} {explicit[name]} contradicts --init-from {source}, "
                                f"whose {name} is {hf[name]}: leave it out")
    shape = gpt_config_from_hf(hf, block_size=explicit.get("block_size"), vocab_size=model.vocab_size)
    return dataclasses.replace(shape, attention=model.attention, loss=model.loss, softmax=model.softmax)


# ----------------------------------------------------------------------------------------- weights
def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise GptspeedError("reading model.safetensors needs safetensors: `pip install safetensors`") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorError, OSError
        raise GptspeedError(f"{path} is not a readable safetensors file ({e})") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:  # weights_only: tensors and containers only, no pickled code runs
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise GptspeedError(f"{path} is not a readable weights-only PyTorch file ({type(e).__name__}): "
                            "convert it to safetensors") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise GptspeedError(f"{path} does not hold a flat state dict of tensors")
    return sd


def read_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model folder, names without the ``transformer.`` prefix, as stored
    (HF layout: Conv1D weights ``[in, out]``). Prefers safetensors over ``pytorch_model.bin``;
    sharded checkpoints are read through their ``*.index.json``.

    Raises:
        GptspeedError: no weights file, or one that cannot be read.
    """
    folder = Path(folder)
    name = next((n for n in _WEIGHT_FILES if (folder / n).is_file()), None)
    if name is None:
        raise GptspeedError(f"{folder} has no weights ({' or '.join(_WEIGHT_FILES)})")
    loader = _load_safetensors if name.startswith("model.safetensors") else _load_bin
    if name.endswith(".index.json"):
        weight_map = _read_json(folder / name).get("weight_map")
        if not isinstance(weight_map, dict):
            raise GptspeedError(f"{folder / name} has no weight_map")
        sd = {}
        for shard in sorted(set(weight_map.values())):
            sd.update(loader(folder / shard))
    else:
        sd = loader(folder / name)
    return {k.removeprefix("transformer."): v for k, v in sd.items()}


def hf_to_gpt_state_dict(hf_sd: dict[str, torch.Tensor], config: GPTConfig, *, where: str = "the model",
                         tied: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict (fp32, ``transformer.``-prefixed, ``lm_head.weight`` = ``wte``) from HF tensors
    (names without prefix). ``wte`` is padded with zero rows to ``config.vocab_size``, ``wpe`` cut
    to ``config.block_size`` rows, Conv1D weights transposed.

    Raises:
        GptspeedError: a tensor is missing or of the wrong shape, or an untied LM head differs
            from the token embedding (our GPT ties them).
    """
    C, L = config.n_embd, config.n_layer
    expected = {"wte.weight": None, "wpe.weight": None, "ln_f.weight": (C,), "ln_f.bias": (C,)}
    shapes = {"ln_1.weight": (C,), "ln_1.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
              "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C),
              "attn.c_proj.bias": (C,), "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
              "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,)}
    for i in range(L):
        expected.update({f"h.{i}.{p}": shapes[p] for p in _BLOCK_PARAMS})
    missing = [k for k in expected if k not in hf_sd]
    if missing:
        raise GptspeedError(f"{where} lacks {missing[0]}" + (f" and {len(missing) - 1} more tensors" if len(missing) > 1
                            else "") + f": not a complete GPT-2 with {L} layers")
    for k, shape in expected.items():
        if shape is not None and tuple(hf_sd[k].shape) != shape:
            raise GptspeedError(f"{where}: {k} has shape {tuple(hf_sd[k].shape)}, expected {shape} "
                                "(a Conv1D [in, out] weight)")
    wte, wpe = hf_sd["wte.weight"].float(), hf_sd["wpe.weight"].float()
    if wte.dim() != 2 or wte.shape[1] != C or wte.shape[0] > config.vocab_size:
        raise GptspeedError(f"{where}: wte.weight has shape {tuple(wte.shape)}, expected (<= {config.vocab_size}, {C})")
    if wpe.dim() != 2 or wpe.shape[1] != C or wpe.shape[0] < config.block_size:
        raise GptspeedError(f"{where}: wpe.weight has shape {tuple(wpe.shape)}, expected (>= {config.block_size}, {C})")
    head = hf_sd.get("lm_head.weight")
    if head is not None and not tied and not torch.equal(head.float(), wte):
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
    sd = hf_to_gpt_state_dict(read_hf_state_dict(folder), c, where=str(folder),
                              tied=bool(hf["tie_word_embeddings"]))
    with torch.no_grad():
        model.load_state_dict(sd)
    return folder


def load_hf_model(source: str, *, block_size: int | None = None) -> tuple[GPT, dict[str, Any]]:
    """A :class:`GPT` (fp32, CPU, eval mode) holding the HF GPT-2 ``source`` (folder or name).
    Returns ``(model, info)`` with ``info = {"source", "folder", "hf_config"}``."""
    folder = resolve_source(source)
    hf = read_hf_config(folder)
    model = GPT(gpt_config_from_hf(hf, block_size=block_size))
    load_hf_weights(model, str(folder))
    return model.eval(), {"source": source, "folder": str(folder), "hf_config": hf}


# ------------------------------------------------------------------------------------- import-hf
def run_config_for(model_config: GPTConfig, **train_fields):
    """A :class:`RunConfig` for an imported model: the preset of the same shape (gpt2 ...) if one
    matches, else the ``gpt2`` preset's training settings, with ``model_config`` as the model."""
    from gptspeed.config import PRESETS, preset

    name = next((n for n, p in PRESETS.items() if (p.model.n_layer, p.model.n_head, p.model.n_embd)
                 == (model_config.n_layer, model_config.n_head, model_config.n_embd)), None)
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
        GptspeedError: as :func:`load_hf_model`; ``out`` already holds checkpoints or is not writable.
    """
    from gptspeed.checkpoint import refuse_checkpoints, save_checkpoint

    out = Path(out)
    refuse_checkpoints(out, "choose another --out")
    model, info = load_hf_model(source)
    cfg = run_config_for(model.config, out=str(out), init_from=str(source))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GptspeedError(f"cannot create run folder {out}: {e.strerror or e}") from None
    source_info = {"hf_source": str(source), "hf_folder": info["folder"]}
    path = save_checkpoint(out, {"step": 0, "model": model.state_dict(), "config": cfg.to_dict(),
                                 "source": source_info}, keep=1)
    write_text_atomic(out / "config.json", json.dumps({**cfg.to_dict(), "source": source_info}, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------- export-hf
def hf_config_dict(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` for ``transformers.GPT2LMHeadModel`` with our shape (vocabulary unpadded).
    Dropout is 0: gptspeed trains without it."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.valid_vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "bos_token_id": 50256, "eos_token_id": 50256,
        "dtype": "float32",
    }


def gpt_to_hf_state_dict(sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF ``GPT2LMHeadModel`` tensors (``transformer.``-prefixed, Conv1D weights ``[in, out]``, fp32,
    contiguous) from our state dict; the padding rows of ``wte`` are removed and ``lm_head.weight``
    is left out (transformers ties it to ``wte`` on load; safetensors cannot store shared tensors)."""
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight" or not k.startswith("transformer."):
            continue
        t = t.detach().float().cpu()
        if k == "transformer.wte.weight":
            t = t[: config.valid_vocab_size]
        elif k.endswith(CONV1D):
            t = t.t()
        out[k] = t.contiguous().clone()
    return out


def write_tokenizer_files(folder: Path, model_max_length: int = 1024) -> None:
    """GPT-2's tokenizer in HF's layout, from the local OpenAI files (no network):
    ``vocab.json`` = ``encoder.json``, ``merges.txt`` = ``vocab.bpe``, plus the configs."""
    from gptspeed.tokenizer import tokenizer_files

    encoder_json, vocab_bpe = tokenizer_files()
    shutil.copyfile(encoder_json, folder / "vocab.json")
    shutil.copyfile(vocab_bpe, folder / "merges.txt")
    eot = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "add_prefix_space": False,
        "bos_token": eot, "eos_token": eot, "unk_token": eot,
    }, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": eot, "eos_token": eot, "unk_token": eot}, indent=2) + "\n")


def _apply_umask(folder: Path) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``: 0700) and the files in it the permissions
    every other file gets: 0777 / 0666 less the user's umask."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def export_hf(run: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """``gptspeed export-hf``: the newest checkpoint of ``run`` as a Hugging Face folder ``out``
    (``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``). Written
    into a temporary folder beside ``out`` and renamed, so ``out`` is never half-written. Returns ``out``.

    Raises:
        GptspeedError: no checkpoint in ``run``; ``out`` exists (without ``force``); not writable.
    """
    from gptspeed.checkpoint import load_latest_run

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise GptspeedError("export-hf writes safetensors: `pip install safetensors`") from None
    out = Path(out)
    if out.exists() and not force:
        raise GptspeedError(f"{out} already exists: choose another --out or pass --force to replace it")
    ckpt, run_config = load_latest_run(Path(run))
    config = run_config.model
    if config.softmax == "data":
        raise GptspeedError(f"{run} was trained with --softmax data (its LM head covers only the tokens of its training "
                            "data); transformers' GPT-2 has no such restriction, so it cannot be exported faithfully")
    tensors = gpt_to_hf_state_dict(ckpt["model"], config)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise GptspeedError(f"cannot write to {out.parent}: {e.strerror or e}") from None
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 50256, "eos_token_id": 50256}, indent=2) + "\n")
        write_tokenizer_files(tmp, config.block_size)
        _apply_umask(tmp)
        if out.exists():  # --force: move the old folder aside, swap, then delete it
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        raise GptspeedError(f"could not write {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
