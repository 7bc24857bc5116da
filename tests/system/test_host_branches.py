"""Every branch a host picks by default (dtype, compile, the loss path), forced on every host, through the commands a user runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from support.cli import assert_user_error, run_main
from support.settings import BRANCH_IDS, BRANCHES, branch_run
from support.training import records, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


DTYPES = ["bfloat16", "float32", "float16"]


SOFTMAXES = ["data", "full"]


PROMPT = "ROMEO:"


HS_EXAMPLES = [
    {
        "ctx": "A man is sitting on a roof. he",
        "label": 3,
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a cube.",
            "starts pulling up roofing on a roof.",
        ],
    },
    {
        "ctx": "A woman puts a tray into the oven. She",
        "label": 0,
        "endings": ["closes the door and sets a timer.", "eats the tray.", "sings to the cat.", "waits."],
    },
    {
        "ctx": "KING HENRY: My lord,",
        "label": 1,
        "endings": ["the sea is blue.", "I will go.", "a dog barks loudly at the moon tonight.", "yes."],
    },
]


@pytest.fixture(scope="module")
def runs(shakespeare_data, tmp_path_factory) -> dict:
    """``{"data": RUN, "full": RUN, "hs": FILE, "export": HF_FOLDER}``: pico runs trained 2 steps in
    float32 with each --softmax, a HellaSwag-format file, and the --softmax full run exported."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for softmax in SOFTMAXES:
        run = root / f"run-{softmax}"
        res = run_main(
            "train",
            "--preset",
            "pico",
            "--data",
            str(shakespeare_data),
            "--out",
            str(run),
            "--max-steps",
            "2",
            "--eval-every",
            "0",
            "--softmax",
            softmax,
            "--device",
            "cpu",
            "--dtype",
            "float32",
        )
        assert res.returncode == 0, res.stderr
        out[softmax] = run
    out["hs"] = root / "hs.jsonl"
    out["hs"].write_text("".join(json.dumps(ex) + "\n" for ex in HS_EXAMPLES))
    res = run_main("export-hf", "--run", str(out["full"]), "--out", str(root / "export"))
    assert res.returncode == 0, res.stderr
    out["export"] = root / "export"
    return out


def device_for(dtype: str, run: Path) -> str:
    """The device a dtype runs on here: the CPU, or for float16 a CUDA GPU. Without one, float16 is
    checked to be refused in one line (the CPU has no float16 autocast gptspeed supports), then skipped."""
    if dtype != "float16":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    res = run_main("sample", "--run", str(run), "--max-new-tokens", "1", "--device", "cpu", "--dtype", "float16")
    assert_user_error(res, "--dtype float16 is not supported on a CPU")
    pytest.skip("float16 does not run on a CPU (gptspeed refuses it in one line, checked here): needs a CUDA GPU")


def strict_json(text: str):
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def reference(runs, shakespeare_data) -> dict:
    """float32 figures of each run: val loss on the first 1,024 val tokens, HellaSwag ending losses."""
    from gptspeed.data import find_shards
    from gptspeed.eval.hellaswag import load_hellaswag, score_items
    from gptspeed.eval.val_loss import evaluate
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_model

    rt = resolve_runtime("cpu", "float32", compile=False)
    items = load_hellaswag(runs["hs"])
    out = {}
    for softmax in SOFTMAXES:
        model, _ = load_model(runs[softmax], rt)
        loss, _ = evaluate(model, rt, find_shards(shakespeare_data, "val"), 2, model.config.block_size, 1024)
        total, _ = score_items(model, items, "cpu")
        out[softmax] = (loss, total)
    return out


@pytest.mark.parametrize("kv", ["kv-cache", "no-kv-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_sample(runs, softmax, dtype, kv):
    """The command runs under the forced dtype (the bf16 --softmax data crash was here), and every
    token drawn under that dtype's autocast is one the model may produce: a token of the data for
    --softmax data, a real (unpadded) GPT-2 token for --softmax full."""
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import generate, generate_cached, load_model

    run = runs[softmax]
    device = device_for(dtype, run)
    flag = ["--no-kv-cache"] if kv == "no-kv-cache" else []
    res = run_main(
        "sample",
        "--run",
        str(run),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--temperature",
        "1.0",
        "--device",
        device,
        "--dtype",
        dtype,
        *flag,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(PROMPT) and len(res.stdout) > len(PROMPT) + 1

    rt = resolve_runtime(device, dtype, compile=False)
    model, _ = load_model(run, rt)
    idx = torch.tensor([[11, 12, 13], [21, 22, 23]], device=rt.device)
    gen = generate_cached if kv == "kv-cache" else generate
    g = torch.Generator(device=rt.device).manual_seed(0)
    tokens = torch.stack(list(gen(model, idx, 24, temperature=1.0, generator=g, autocast=rt.autocast())), 1)
    if softmax == "data":
        allowed = set(model.softmax_ids.tolist())
        assert len(allowed) == 11_707  # tiny Shakespeare's distinct tokens, not the whole vocabulary
    else:
        allowed = set(range(50257))  # never a padding row
    assert set(tokens.flatten().tolist()) <= allowed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_eval_val_loss_and_hellaswag(runs, reference, shakespeare_data, softmax, dtype):
    """`eval --data --hellaswag-file` under the forced dtype prints strict JSON whose val loss is the
    float32 one to within the dtype's rounding; HellaSwag's ending losses likewise (scored under
    that dtype's autocast)."""
    from gptspeed.eval.hellaswag import load_hellaswag, score_items
    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_model

    run = runs[softmax]
    device = device_for(dtype, run)
    res = run_main(
        "eval",
        "--run",
        str(run),
        "--data",
        str(shakespeare_data),
        "--max-tokens",
        "1024",
        "--batch-size",
        "2",
        "--hellaswag-file",
        str(runs["hs"]),
        "--device",
        device,
        "--dtype",
        dtype,
    )
    assert res.returncode == 0, res.stderr
    out = strict_json(res.stdout)
    ref_loss, ref_total = reference[softmax]
    tol = 1e-4 if dtype == "float32" else 0.05
    assert out["tokens"] == 1024 and abs(out["val_loss"] - ref_loss) <= tol * ref_loss, (out, ref_loss)
    assert math.isclose(out["perplexity"], math.exp(out["val_loss"]))
    hs = out["hellaswag"]
    assert hs["examples"] == 3 and 0 <= hs["acc_norm"] <= 1 and hs["nan_examples"] == 0 and "note" not in out

    rt = resolve_runtime(device, dtype, compile=False)
    model, _ = load_model(run, rt)
    total, _ = score_items(model, load_hellaswag(runs["hs"]), rt.device, rt.autocast())
    finite = torch.isfinite(ref_total)
    assert torch.equal(torch.isfinite(total.cpu()), finite)  # --softmax data: the same endings impossible
    assert torch.allclose(total.cpu()[finite], ref_total[finite], rtol=tol)


def test_export_of_a_softmax_data_run_carries_its_token_ids(runs, tmp_path):
    """It was refused; it now exports through gptspeed's modeling code with its data's ids
    (tests/hf/test_export.py checks the logits)."""
    import json

    from gptspeed.runtime import resolve_runtime
    from gptspeed.sample import load_model

    res = run_main("export-hf", "--run", str(runs["data"]), "--out", str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr
    model, _ = load_model(runs["data"], resolve_runtime("cpu", "float32", compile=False))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["softmax_ids"] == model.softmax_ids.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_export_computes_as_the_run_under_each_dtype(runs, shakespeare_data, dtype):
    """The export of the --softmax full run, loaded back (--init-from), samples the same greedy
    tokens and gives the same val loss as the run itself under the forced dtype."""
    run, export = runs["full"], runs["export"]
    device = device_for(dtype, run)
    common = ["--device", device, "--dtype", dtype]
    greedy = ["--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0", *common]
    a = run_main("sample", "--run", str(run), *greedy)
    b = run_main("sample", "--init-from", str(export), *greedy)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.startswith(PROMPT)
    evals = [
        run_main("eval", src, str(path), "--data", str(shakespeare_data), "--max-tokens", "1024", *common)
        for src, path in (("--run", run), ("--init-from", export))
    ]
    assert all(e.returncode == 0 for e in evals), [e.stderr for e in evals]
    la, lb = (strict_json(e.stdout)["val_loss"] for e in evals)
    assert abs(la - lb) <= 1e-5 * la, (la, lb)


@pytest.mark.parametrize("dtype, softmax, loss, compile", BRANCHES, ids=BRANCH_IDS)
def test_each_branch_trains(reference_run, dtype, softmax, loss, compile):
    """The branch asked for ran (not the host's) and learns. That its run resumes to the same losses, to the bit,
    is a case of tests/system/test_exact_resume.py, on the same (shared) run."""
    full = reference_run(*branch_run(dtype, softmax, loss, compile))
    derived = json.loads((full / "config.json").read_text())["derived"]
    assert (derived["dtype"], derived["compile"]) == (dtype, compile)  # the branch asked for ran, not the host's
    ref = train_losses(full)
    assert len(ref) == 3 and all(torch.isfinite(torch.tensor(v)) for v in ref.values())
    vals = [r["val_loss"] for r in records(full) if r.get("val_loss") is not None]
    assert len(vals) == 3 and vals[-1] < vals[0]  # steps 0, 2 and 3 (the last): it learns
